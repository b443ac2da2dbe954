"""Calibrate `pagedserve simulate` on vLLM's own live server, then predict vLLM on other workloads.

vLLM writes no step trace, so calibration uses only what any vLLM deployment offers:
`pagedserve bench --dataset calibration` runs against it (every streamed token's arrival:
`pagedserve simulate calibrate --from-bench` rebuilds the engine steps from them) and its
/metrics scraped before and after each (the engine's own queue and prefill times: what the
client's TTFT holds beyond them is the serving overhead). One calibration run per round,
before that round's held-out runs; the cost model is fitted on all of them together (this
machine's speed drifts by tens of percent over minutes: one calibration run before all the
rest saw its own minutes, 2026-12-05: the held-out steps ran 13-22% under the model fitted on
it). The first round's calibration alone sets the held-out request rate. The simulator then runs
pagedserve's scheduler with vLLM's knobs (max_num_seqs, max_num_batched_tokens, block size
and pool size read from its cache_config_info) and that cost model, and is compared with
`pagedserve bench` against the same vLLM server on workloads the calibration never saw,
REPEATS runs each.

    OMP_NUM_THREADS=1 python benchmarks/sim_vs_vllm.py [--python /tmp/peers/vllm/bin/python] [--repeats 3]
        [--serving-layer calibrated|measured] [--serving-fit replay|subtract]
    OMP_NUM_THREADS=1 python benchmarks/sim_vs_vllm.py --resimulate [--serving-fit ...]

--resimulate runs no vLLM: it calibrates again from the last run's saved calibration runs
(results/sim_vs_vllm/calib*.bench.json and their scrapes) and simulates the held-out workloads that run measured (their flags
and vLLM's figures from results/sim_vs_vllm.json), writing results/sim_vs_vllm.resim.json. The
calibration run alone sets every constant (step costs, admission); the held-out results are only
compared with, never fitted to.

The vLLM CPU build lives in its own venv (see ../shared/peers/README.md); it is never a
dependency of pagedserve. One OpenMP thread, bound to no core (the machine is shared).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import ROOT, benchmark_checkpoint  # noqa: E402
from live import Server, env, free_port, load_average, run_bench  # noqa: E402

VLLM_KNOBS = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 1024}
# The calibration ramp must fill the batch up to max_num_seqs (16), or the cost of the larger decode batches is
# extrapolated: 120 prompts with outputs up to 120 tokens at --calibration-rate 6 (before 2026-12-05, fourth
# sitting) put 13-20 of ~2,500 rebuilt steps at a decode batch of 5 or more, and the fitted per-request slope,
# carried on from batches 1-4, priced vLLM's batch 5-16 steps 1.15-1.65x what they took. 200 prompts with outputs up
# to 240 at rate 10: the simulator puts ~700 of ~3,800 steps there, and the run lasts as long (~34 s).
CALIBRATION = ["--dataset", "calibration", "--random-input-len", "200", "--random-output-len", "120",
               "--num-prompts", "200", "--seed", "201"]
METRICS = [("output_throughput", "output tok/s", "{:.1f}"), ("mean_ttft_ms", "mean TTFT ms", "{:.0f}"),
           ("p99_ttft_ms", "P99 TTFT ms", "{:.0f}"), ("mean_itl_ms", "mean ITL ms", "{:.1f}"),
           ("p99_itl_ms", "P99 ITL ms", "{:.0f}"), ("num_preemptions", "preemptions", "{:.0f}")]
GOAL_KEYS = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "p99_itl_ms")


def workloads(rate: float, num_prompts: int = 256) -> list[tuple[str, list[str]]]:
    """The held-out workloads at `rate` req/s, `num_prompts` requests each (64 before 2026-12-05: a P99 of 64 is the
    largest but one)."""
    n = str(num_prompts)
    return [
        ("random lengths, ~80% busy", ["--dataset", "random", "--random-input-len", "160", "--random-output-len", "64",
                                       "--random-range-ratio", "0.5", "--num-prompts", n, "--request-rate",
                                       f"{rate:.3f}", "--seed", "1"]),
        ("long-context mix", ["--dataset", "long-context", "--long-input-len", "480", "--short-input-len", "64",
                              "--long-fraction", "0.2", "--random-output-len", "48", "--num-prompts", n,
                              "--request-rate", f"{rate:.3f}", "--seed", "2"]),
    ]


def vllm_server(python: str, model: Path, log: Path, kv_gib: int) -> Server:
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", str(VLLM_KNOBS["max_model_len"]),
           "--max-num-seqs", str(VLLM_KNOBS["max_num_seqs"]),
           "--max-num-batched-tokens", str(VLLM_KNOBS["max_num_batched_tokens"]),
           "--no-enable-prefix-caching", "--served-model-name", "m"]  # vLLM >= 0.11 logs no requests by default
    extra = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
             "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    e = env(1, extra)
    e.pop("PYTHONPATH", None)  # vLLM's venv must not see this checkout
    return Server(cmd, port, log, e, timeout_s=900)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def cache_config(text: str) -> dict:
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info"):
            return dict(re.findall(r'(\w+)="([^"]*)"', line))
    return {}


def calibrated(model, work: Path, cost: Path, block_size: int, args, rounds=None) -> str | None:
    """`simulate calibrate` on the saved calibration runs (those of `rounds`, default all) into `cost`
    (with vLLM's measured serving layer swapped in under --serving-layer measured): its output, or
    None when it failed."""
    proc = calibrate(model, calibration_stems(work, rounds), cost, block_size, args.serving_fit, args.step_spread)
    if proc.returncode:
        return None
    if args.serving_layer == "measured":
        use_measured_serving(cost)
    return proc.stdout


def use_measured_serving(cost: Path) -> None:
    """Replace the calibrated cost model's serving layer with vLLM's measured one (the probe machine's
    speed: right for vLLM on this machine)."""
    from pagedserve.sim.host_overhead import vllm_serving

    measured = vllm_serving()
    if measured is None:
        raise SystemExit("--serving-layer measured: no pagedserve/sim/host_overhead_vllm.json")
    data = json.loads(cost.read_text())
    data["params"]["serving"] = {**measured, "serial": True}
    cost.write_text(json.dumps(data, indent=2))
    print(f"serving layer: vLLM's, measured ({measured['source']})", flush=True)


def real_metrics(result: dict, before: str, after: str) -> dict:
    from pagedserve.sim.reconstruct import VLLM_PREFILL, VLLM_QUEUE, histogram_mean

    s = result["summary"]

    def counter(text, name):
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", text, re.M))

    # where the client's TTFT went, by vLLM's own account: its engine queue and prefill (the rest is the API server)
    queue, _ = histogram_mean(before, after, VLLM_QUEUE)
    prefill, _ = histogram_mean(before, after, VLLM_PREFILL)
    return {"output_throughput": s["output_throughput"], "mean_ttft_ms": s["ttft_ms"]["mean"],
            "p99_ttft_ms": s["ttft_ms"]["p99"], "mean_itl_ms": s["itl_ms"]["mean"], "p99_itl_ms": s["itl_ms"]["p99"],
            "num_preemptions": counter(after, "vllm:num_preemptions_total")
            - counter(before, "vllm:num_preemptions_total"),
            "engine_queue_ms": None if queue is None else queue * 1e3,
            "engine_prefill_ms": None if prefill is None else prefill * 1e3,
            "failed": s["failed_requests"]}


def sim_config(block_size: int, num_blocks: int):
    from pagedserve.config import EngineConfig

    return EngineConfig(max_num_seqs=VLLM_KNOBS["max_num_seqs"],
                        max_num_batched_tokens=VLLM_KNOBS["max_num_batched_tokens"],
                        max_model_len=VLLM_KNOBS["max_model_len"], block_size=block_size, num_kv_blocks=num_blocks,
                        enable_prefix_caching=False, enable_chunked_prefill=True, preemption_mode="recompute")


def simulate_flags(model: Path, cost: Path, flags: list[str], block_size: int, num_blocks: int,
                   draws: int = 5) -> dict:
    from pagedserve.cli import build_parser
    from pagedserve.sim.cli import build_workload
    from pagedserve.sim.simulator import build_deployment, simulate

    args = build_parser().parse_args(["simulate", "--device", "cpu", "--model", str(model), *flags])
    runs = []
    for k in range(draws):
        dep = build_deployment(sim_config(block_size, num_blocks), str(model), cost_params=cost)
        res = simulate(dep, build_workload(args, dep.vocab_size, dep.config.max_model_len), seed=k)
        m = res.metrics
        runs.append({"output_throughput": m["output_throughput"], "mean_ttft_ms": m["mean_ttft_ms"],
                     "p99_ttft_ms": m["p99_ttft_ms"], "mean_itl_ms": m["mean_itl_ms"], "p99_itl_ms": m["p99_itl_ms"],
                     "num_preemptions": float(res.num_preemptions),
                     "busy_fraction": res.busy_time / m["duration"] if m["duration"] else 0.0})
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def rate_for_busy(model: Path, cost: Path, block_size: int, num_blocks: int, target: float = 0.8) -> float:
    lo, hi = 0.05, 20.0
    for _ in range(12):
        mid = math.sqrt(lo * hi)
        busy = simulate_flags(model, cost, workloads(mid)[0][1], block_size, num_blocks, draws=1)["busy_fraction"]
        lo, hi = (mid, hi) if busy < target else (lo, mid)
    return math.sqrt(lo * hi)


def error(sim: float, real: float) -> float | None:
    if real is None or math.isnan(real) or math.isnan(sim):
        return None
    return (sim - real) / real if real else (0.0 if sim == 0 else math.inf)


def fmt_err(e) -> str:
    return "n/a" if e is None else ("real 0" if math.isinf(e) else f"{e:+.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default="/tmp/peers/vllm/bin/python", help="the vLLM venv's python")
    ap.add_argument("--model", default="20m", help="a benchmarks/common.py size, or a checkpoint directory")
    ap.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--calibration-rate", type=float, default=10.0,
                    help="the calibration workload ramps from 0.1x to 2x this rate (10: decode batches fill up to "
                         "max_num_seqs; at 6, with shorter outputs, fewer than 1%% of steps had a batch over 4)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate", type=float, default=None,
                    help="the held-out request rate (default: the rate the first calibration simulates 80%% busy)")
    ap.add_argument("--num-prompts", type=int, default=256,
                    help="requests per held-out run (256; before 2026-12-05 64, where a P99 is the largest request "
                         "but one and the same workload's P99 TTFT spanned 2-5x between runs)")
    ap.add_argument("--serving-layer", choices=("calibrated", "measured"), default="calibrated",
                    help="the simulated serving layer: calibrated = the calibration run's client TTFT less the "
                         "engine's (one constant admission); measured = vLLM's API server as "
                         "benchmarks/vllm_host_probe.py measured it on this machine (pagedserve/sim/"
                         "host_overhead_vllm.json: per request, per prompt token, per chunk; one event loop)")
    ap.add_argument("--serving-fit", choices=("replay", "subtract"), default="replay",
                    help="how the calibrated admission is fitted (`simulate calibrate --serving-fit`): replay = "
                         "the calibration run replayed in the simulator until its mean TTFT is the client's; "
                         "subtract = the client's TTFT less vLLM's queue + prefill (counts the wait for a "
                         "running step twice)")
    ap.add_argument("--step-spread", action=argparse.BooleanOptionalAction, default=True,
                    help="add the calibration's step scatter to every simulated step (`simulate calibrate "
                         "--step-spread`; --no-step-spread: every step its modelled time)")
    ap.add_argument("--resimulate", action="store_true",
                    help="run no vLLM: calibrate from the saved calibration run and simulate the saved held-out "
                         "workloads (results/sim_vs_vllm.json), writing results/sim_vs_vllm.resim.json")
    ap.add_argument("--out", default=str(ROOT / "results" / "sim_vs_vllm.json"))
    args = ap.parse_args()
    model = benchmark_checkpoint(args.model) if not Path(args.model).is_dir() else Path(args.model)
    work = Path(args.out).parent / "sim_vs_vllm"
    if args.resimulate:
        return resimulate(args, model, work)
    if not Path(args.python).exists():
        print(f"no vLLM at {args.python}: see ../shared/peers/README.md (setup.sh)")
        return 2
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print(f"model {model}; load average {load_average()}", flush=True)

    with vllm_server(args.python, model, work / "vllm.log", args.kv_gib) as server:
        version = subprocess.run([args.python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                 text=True, env=env(1)).stdout.strip()
        run_bench(server.url, ["--dataset", "random", "--random-input-len", "64", "--random-output-len", "8",
                               "--num-prompts", "4", "--no-metrics"], work / "warmup.json", work / "warmup.log")
        before = scrape(server.url)
        cfg = cache_config(before)
        block_size, num_blocks = int(cfg.get("block_size", 16)), int(cfg.get("num_gpu_blocks", 0) or 0)
        print(f"vLLM {version}: block size {block_size}, {num_blocks} KV blocks; cache_config_info {cfg}", flush=True)
        for old in work.glob("calib*"):
            old.unlink()
        first = work / "cost_vllm.first.json"
        for attempt in range(3):  # `calibrate` leaves out a run whose output came in bursts: run it again
            calibration_run(server.url, work, 0, args.calibration_rate, before)
            if calibrated(model, work, first, block_size, args, rounds=[0]) is not None:
                break
            print("the first calibration run was left out (its steps could not be rebuilt): running it again",
                  flush=True)
            before = scrape(server.url)
        else:
            return 1
        if args.rate:
            rate = args.rate
            print(f"request rate: {rate:.3f} req/s (--rate)", flush=True)
        else:
            rate = rate_for_busy(model, first, block_size, num_blocks)
            print(f"request rate for 80% busy (simulated on the first calibration run): {rate:.3f} req/s", flush=True)
        chosen = workloads(rate, args.num_prompts)
        runs: dict[str, list[dict]] = {name: [] for name, _ in chosen}
        for rep in range(args.repeats):
            if rep:
                calibration_run(server.url, work, rep, args.calibration_rate, scrape(server.url))
            for k, (name, flags) in enumerate(chosen):
                before = scrape(server.url)
                load0 = load_average()
                m = bench_run(server.url, flags, work, f"run{rep}_{k}", before)
                runs[name].append(m)
                split = (f"; of the mean TTFT, engine queue {m['engine_queue_ms']:.1f} + prefill "
                         f"{m['engine_prefill_ms']:.1f} ms" if m["engine_queue_ms"] is not None
                         and m["engine_prefill_ms"] is not None else "")
                print(f"[{rep}] {name}: load {load0} -> {load_average()}; "
                      + ", ".join(f"{label} {fmt.format(m[key])}" for key, label, fmt in METRICS) + split, flush=True)

    cost = work / "cost_vllm.json"
    calibration = calibrated(model, work, cost, block_size, args)
    if calibration is None:
        return 1
    print("the first round's calibration run alone (what calibrating once gives):")
    _, met_first, _ = compare(model, first, chosen, runs, block_size, num_blocks)
    print(f"\nall {args.repeats} calibration runs, fitted together:")
    table, met, goals = compare(model, cost, chosen, runs, block_size, num_blocks)
    print(f"total {time.time() - t0:.0f} s; load average now {load_average()}")
    Path(args.out).write_text(json.dumps({"vllm": version, "model": str(model), "knobs": VLLM_KNOBS,
                                          "cache_config": cfg, "calibration_rate": args.calibration_rate,
                                          "rate_for_busy": rate, "calibration": calibration, "workloads": table,
                                          "serving_fit": args.serving_fit, "step_spread": args.step_spread,
                                          "goals_met": met, "goals_met_first_calibration": met_first,
                                          "goals_total": len(goals)}, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0


def bench_run(url: str, flags: list[str], work: Path, stem: str, before: str) -> dict:
    """One `pagedserve bench` run against the server: its result (STEM.bench.json, .log) and the /metrics scraped
    around it (STEM.metrics.before/after.txt) saved; returns real_metrics of it."""
    result = run_bench(url, flags, work / f"{stem}.bench.json", work / f"{stem}.log")
    after = scrape(url)
    (work / f"{stem}.metrics.before.txt").write_text(before)
    (work / f"{stem}.metrics.after.txt").write_text(after)
    return real_metrics(result, before, after)


def calibration_run(url: str, work: Path, rnd: int, rate: float, before: str) -> None:
    """One calibration run (round `rnd`), its result and the scrapes around it saved for the fit."""
    load0 = load_average()
    m = bench_run(url, CALIBRATION + ["--request-rate", f"{rate:g}"], work, f"calib{rnd}", before)
    print(f"[{rnd}] calibration run: load {load0} -> {load_average()}; {json.dumps(m)}", flush=True)


def calibration_stems(work: Path, rounds=None) -> list[Path]:
    """The saved calibration runs (calib0, calib1, ...; a run before 2026-12-05 saved one, `calib`)."""
    stems = sorted((p.with_name(p.name[:-len(".bench.json")]) for p in work.glob("calib*.bench.json")),
                   key=lambda p: (len(p.name), p.name))
    return [st for k, st in enumerate(stems) if rounds is None or k in rounds]


def calibrate(model: Path, stems: list[Path], cost: Path, block_size: int, serving_fit: str, spread: bool = True):
    """`simulate calibrate --from-bench` on the saved calibration runs `stems` (their bench results and
    the /metrics scraped around each): nothing else sets a constant."""
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "simulate", "calibrate", "--model", str(model),
                           "--from-bench", *[str(st.with_name(st.name + ".bench.json")) for st in stems],
                           "--block-size", str(block_size),
                           "--metrics-before", *[str(st.with_name(st.name + ".metrics.before.txt")) for st in stems],
                           "--metrics-after", *[str(st.with_name(st.name + ".metrics.after.txt")) for st in stems],
                           "--max-model-len", str(VLLM_KNOBS["max_model_len"]),
                           "--max-num-seqs", str(VLLM_KNOBS["max_num_seqs"]),
                           "--max-num-batched-tokens", str(VLLM_KNOBS["max_num_batched_tokens"]),
                           "--serving-fit", serving_fit, "--step-spread" if spread else "--no-step-spread",
                           "--out", str(cost)],
                          env=env(), capture_output=True, text=True)
    print(proc.stdout, proc.stderr[-2000:], flush=True)
    return proc


def resimulate(args, model: Path, work: Path) -> int:
    """Calibrate again from the saved calibration run and simulate the saved held-out workloads."""
    saved_path = Path(args.out)
    if not saved_path.exists() or not calibration_stems(work):
        print(f"--resimulate: needs {saved_path} and {work}/calib*.bench.json from an earlier full run")
        return 2
    saved = json.loads(saved_path.read_text())
    cfg = saved["cache_config"]
    block_size, num_blocks = int(cfg.get("block_size", 16)), int(cfg.get("num_gpu_blocks", 0) or 0)
    cost = work / "cost_vllm.resim.json"
    calibration = calibrated(model, work, cost, block_size, args)
    if calibration is None:
        return 1
    chosen = [(t["name"], t["flags"]) for t in saved["workloads"]]
    runs = {t["name"]: t["real_runs"] for t in saved["workloads"]}
    table, met, goals = compare(model, cost, chosen, runs, block_size, num_blocks)
    out = saved_path.with_suffix(".resim.json")
    out.write_text(json.dumps({"resimulated_from": str(saved_path), "vllm": saved.get("vllm"),
                               "serving_fit": args.serving_fit, "step_spread": args.step_spread,
                               "calibration": calibration, "workloads": table,
                               "goals_met": met, "goals_total": len(goals)}, indent=2, default=str))
    print(f"wrote {out}")
    return 0


def compare(model: Path, cost: Path, chosen, runs, block_size: int, num_blocks: int):
    """Simulate each held-out workload and print it beside vLLM's runs."""
    lines = ["| workload | metric | vLLM (median of runs) | vLLM runs (min–max) | simulated | error vs median | "
             "inside range |", "|---|---|---:|---:|---:|---:|---|"]
    table = []
    for name, flags in chosen:
        real = {key: statistics.median(r[key] for r in runs[name]) for key, _, _ in METRICS}
        sim = simulate_flags(model, cost, flags, block_size, num_blocks)
        table.append({"name": name, "flags": flags, "real_runs": runs[name], "real_median": real, "sim": sim})
        for key, label, fmt in METRICS:
            values = [r[key] for r in runs[name]]
            inside = "yes" if min(values) <= sim[key] <= max(values) else "no"
            lines.append(f"| {name} | {label} | {fmt.format(real[key])} | {fmt.format(min(values))}–"
                         f"{fmt.format(max(values))} | {fmt.format(sim[key])} | {fmt_err(error(sim[key], real[key]))} | "
                         f"{inside} |")
    print("\n".join(lines))
    goals = [error(t["sim"][k], t["real_median"][k]) for t in table for k in GOAL_KEYS]
    met = sum(1 for e in goals if e is not None and abs(e) <= 0.10)
    print(f"\n{met} of {len(goals)} goal metrics within 10% of vLLM's median run", flush=True)
    return table, met, goals


if __name__ == "__main__":
    sys.exit(main())
