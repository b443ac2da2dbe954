"""Validate `pagedserve simulate` against the LIVE server, as a user would check it.

1. Calibrate: `pagedserve serve --step-trace-path` (a subprocess on loopback) under
   `pagedserve bench --dataset calibration`, twice: a roomy pool (batch, context and chunk
   shapes) and a small pool with swap preemption (the swap cost); then
   `pagedserve simulate calibrate --trace ... --bench-result ...` fits the step cost and the
   serving overhead. The calibration runs are repeated once per round, between the
   validation runs, and the final cost model is fitted on all of them: this machine's load
   drifts by tens of percent over minutes, and a calibration spread over the same period
   as the runs sees the same machine on average. (The cost model of the first round
   alone, what a user who calibrates once gets, is reported beside it.)
2. Three workloads that calibration never saw, each run REPEATS times against a fresh
   server (one run of each per round):
     random    random lengths at ~80% busy (the rate is the one the simulator says gives 80%)
     prefix    requests sharing 4 long prefixes, prefix caching on
     swap      a burst into a 64-block pool, swap preemption
   and `pagedserve simulate` on the same flags. The table: each metric's median real run, the real runs' range, the
   simulation, its error vs the median, and whether it lies inside the real runs' range.
3. This machine's speed drifts by up to 3x over minutes (other agents' jobs come and go).
   So each real run starts with a 15-second probe on its fresh server (a short calibration-
   style load, not the workload): the probe's steps against the model say how fast the
   machine is right now, and a second prediction scales the cost model by that factor.
   Both predictions use nothing from the run itself. As a diagnostic, the run's own steps
   give the model's error at the run's own speed (what is left is the model's, not the
   machine's), with the per-step error by step kind on that held-out trace.

    OMP_NUM_THREADS=1 python benchmarks/sim_vs_real.py [--repeats 3] [--out results/sim_vs_real.json]

About 25 minutes on 2 shared cores. Torch runs on one thread per process.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import ROOT, benchmark_checkpoint  # noqa: E402
from live import env, load_average, pagedserve_server, run_bench  # noqa: E402

from pagedserve import metric_names as mn  # noqa: E402

ENGINE = ["--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--max-model-len", "1024"]
CALIBRATION = [
    ("roomy", ENGINE + ["--kv-cache-memory", "64MiB", "--no-enable-prefix-caching"],
     ["--dataset", "calibration", "--random-input-len", "300", "--random-output-len", "60",
      "--num-prompts", "100", "--request-rate", "1.5", "--seed", "101"]),
    ("swap", ENGINE + ["--num-kv-blocks", "96", "--max-model-len", "512", "--preemption-mode", "swap",
                       "--swap-space", "1GiB", "--no-enable-prefix-caching"],
     ["--dataset", "calibration", "--random-input-len", "160", "--random-output-len", "120",
      "--num-prompts", "48", "--request-rate", "10", "--seed", "102"]),
]
BUSY_TARGET = 0.8
PROBE = ["--dataset", "calibration", "--random-input-len", "120", "--random-output-len", "32",
         "--num-prompts", "20", "--request-rate", "4", "--seed", "300"]


@dataclass
class Workload:
    name: str
    engine: list[str]
    flags: list[str]              # bench / simulate dataset and load flags (the rate may be filled in)
    runs: list[dict] = field(default_factory=list)


def workloads(rate_random: float) -> list[Workload]:
    return [
        # The rate search (rate_for_busy) stops at 5 req/s, where the simulator says ~55% busy: the name said
        # "~80% busy" until 2026-12-05, which no run reached.
        Workload("random lengths, rate for 80% busy capped at 5 req/s", ENGINE + ["--kv-cache-memory", "64MiB", "--no-enable-prefix-caching"],
                 ["--dataset", "random", "--random-input-len", "160", "--random-output-len", "48",
                  "--random-range-ratio", "0.5", "--num-prompts", "48", "--request-rate", f"{rate_random:.3f}",
                  "--seed", "1"]),
        Workload("prefix repetition, caching on", ENGINE + ["--kv-cache-memory", "64MiB", "--enable-prefix-caching"],
                 ["--dataset", "prefix-repetition", "--prefix-len", "384", "--suffix-len", "32", "--num-prefixes", "4",
                  "--random-output-len", "32", "--num-prompts", "48", "--request-rate", "1.2", "--seed", "2"]),
        Workload("burst into 64 blocks, swap", ENGINE + ["--num-kv-blocks", "64", "--max-model-len", "512",
                                                         "--preemption-mode", "swap", "--swap-space", "1GiB",
                                                         "--no-enable-prefix-caching"],
                 ["--dataset", "random", "--random-input-len", "192", "--random-output-len", "96",
                  "--random-range-ratio", "0.3", "--num-prompts", "32", "--request-rate", "inf", "--seed", "3"]),
        # Added 2026-12-05: the first three never preempt by recompute (the random one's pool is roomy), and the
        # issue asks for recompute, prefix and swap modes.
        Workload("burst into 64 blocks, recompute", ENGINE + ["--num-kv-blocks", "64", "--max-model-len", "512",
                                                              "--preemption-mode", "recompute",
                                                              "--no-enable-prefix-caching"],
                 ["--dataset", "random", "--random-input-len", "192", "--random-output-len", "96",
                  "--random-range-ratio", "0.3", "--num-prompts", "32", "--request-rate", "inf", "--seed", "4"]),
    ]


METRICS = [("output_throughput", "output tok/s", "{:.1f}"), ("mean_ttft_ms", "mean TTFT ms", "{:.0f}"),
           ("p99_ttft_ms", "P99 TTFT ms", "{:.0f}"), ("p99_itl_ms", "P99 ITL ms", "{:.0f}"),
           ("mean_itl_ms", "mean ITL ms", "{:.1f}"), ("num_preemptions", "preemptions", "{:.0f}"),
           ("swapped_blocks", "swapped blocks", "{:.0f}"), ("prefix_hit_rate", "prefix hit rate", "{:.3f}")]
GOAL_KEYS = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "p99_itl_ms")


def real_metrics(result: dict) -> dict:
    s = result["summary"]
    server = s.get("server") or {}
    return {"output_throughput": s["output_throughput"], "mean_ttft_ms": s["ttft_ms"]["mean"],
            "p99_ttft_ms": s["ttft_ms"]["p99"], "p99_itl_ms": s["itl_ms"]["p99"], "mean_itl_ms": s["itl_ms"]["mean"],
            "num_preemptions": server.get(mn.exposed(mn.NUM_PREEMPTIONS), math.nan),
            "swapped_blocks": server.get(mn.exposed(mn.SWAPPED_BLOCKS), math.nan),
            "prefix_hit_rate": server.get("prefix_cache_hit_rate", 0.0),
            "failed": s["failed_requests"]}


def itl_tail_at_scrapes(result: dict) -> tuple[float, int, int, float]:
    """The real run's P99 ITL, how many inter-token gaps lie above it, how many of those span the
    start of one of the bench's mid-run /metrics scrapes (bench and run on one clock), and how many
    would by chance (each gap / the scrape interval): a diagnostic for the bench's own cost in the
    tail, which the simulator does not model."""
    scrapes = sorted((result.get("server_timeline") or {}).get("t") or [])
    gaps = []
    for r in result["requests"]:
        if not r.get("success") or r.get("ttft") is None:
            continue
        t = r["start"] + r["ttft"]
        for itl in r["itl"]:
            gaps.append((itl, t))
            t += itl
    if not gaps:
        return math.nan, 0, 0, 0.0
    values = sorted(g for g, _ in gaps)
    p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
    over = [(g, t) for g, t in gaps if g > p99]
    spanning = sum(1 for g, t in over if any(t <= s < t + g for s in scrapes))
    interval = statistics.median(b - a for a, b in zip(scrapes, scrapes[1:])) if len(scrapes) > 2 else math.inf
    return p99, len(over), spanning, sum(min(1.0, g / interval) for g, _ in over)


def sim_args(model: Path, cost: Path, w: Workload):
    from pagedserve.cli import build_parser

    return build_parser().parse_args(["simulate", "--device", "cpu", "--model", str(model), "--cost-model", str(cost),
                                      *w.engine, *w.flags])


def simulate_workload(model: Path, cost: Path, w: Workload, params=None) -> dict:
    """The workload through `pagedserve simulate`'s own path (its parser, config and workload builder)."""
    from pagedserve.engine_args import engine_config_from_args
    from pagedserve.sim.cli import build_workload
    from pagedserve.sim.simulator import build_deployment, simulate

    args = sim_args(model, cost, w)
    dep = build_deployment(engine_config_from_args(args), args.model, cost_params=params or args.cost_model)
    res = simulate(dep, build_workload(args, dep.vocab_size, dep.config.max_model_len))
    view = res.server_view()
    m = res.metrics
    return {"output_throughput": m["output_throughput"], "mean_ttft_ms": m["mean_ttft_ms"],
            "p99_ttft_ms": m["p99_ttft_ms"], "p99_itl_ms": m["p99_itl_ms"], "mean_itl_ms": m["mean_itl_ms"],
            "num_preemptions": float(res.num_preemptions),
            "swapped_blocks": float(res.num_blocks_swapped_out + res.num_blocks_swapped_in),
            "prefix_hit_rate": view.get("prefix_cache_hit_rate", 0.0),
            "busy_fraction": res.busy_time / m["duration"] if m["duration"] else 0.0, "failed": m["failed"]}


def rate_for_busy(model: Path, cost: Path, target: float = BUSY_TARGET) -> float:
    """The request rate at which the simulator says the engine is busy `target` of the time."""
    lo, hi = 0.05, 5.0
    for _ in range(12):
        mid = math.sqrt(lo * hi)
        busy = simulate_workload(model, cost, workloads(mid)[0])["busy_fraction"]
        lo, hi = (mid, hi) if busy < target else (lo, mid)
    return math.sqrt(lo * hi)


def calibration_round(model: Path, work: Path, rnd: int) -> tuple[list[Path], list[Path], list[dict]]:
    """One round of calibration runs (each phase against a fresh, traced server)."""
    traces, benches, notes = [], [], []
    for name, engine, flags in CALIBRATION:
        stem = work / f"calib{rnd}_{name}"
        trace = stem.with_suffix(".jsonl")
        load0 = load_average()
        with pagedserve_server(model, engine, stem.with_suffix(".serve.log"), trace) as server:
            result = run_bench(server.url, flags, stem.with_suffix(".bench.json"), stem.with_suffix(".bench.log"))
        notes.append({"round": rnd, "phase": name, "load_before": load0, "load_after": load_average(),
                      "summary": real_metrics(result)})
        print(f"calibration run {rnd} '{name}': load {load0} -> {notes[-1]['load_after']}; "
              f"{json.dumps(notes[-1]['summary'])}", flush=True)
        traces.append(trace)
        benches.append(stem.with_suffix(".bench.json"))
    return traces, benches, notes


def fit_cost(model: Path, traces: list[Path], benches: list[Path], out: Path, extra: Sequence[str] = ()) -> str:
    """`pagedserve simulate calibrate` on the given runs (`extra`: more of its flags); returns what it printed."""
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "simulate", "calibrate", "--model", str(model),
                           "--out", str(out), "--max-model-len", "1024", "--trace", *map(str, traces),
                           "--bench-result", *map(str, benches), *extra], env=env(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-3000:])
    return proc.stdout


def held_out_step_errors(cost: Path, model: Path, trace: Path) -> dict:
    """The calibrated model's per-step error on a run it never saw (wall clock: step + gap)."""
    from pagedserve.plan.models import load_model
    from pagedserve.sim.cost_model import (CostModel, ModelCost, error_report, load_params, read_trace,
                                           step_costs)

    params = load_params(cost)
    cm = CostModel(ModelCost.from_shape(load_model(str(model)).shape, "float32", None, 1), params)
    recs = [r for r in read_trace(trace) if r.num_reqs]
    wall, _ = step_costs(recs)
    pred = [cm.predict(r.new_tokens, r.context_lens, r.num_swap_blocks, r.num_outputs) for r in recs]
    rep = error_report(recs, pred, wall)
    rep["wall_over_model"] = sum(wall) / sum(pred)
    rep["busy_s"] = sum(wall)
    rep["speed_windows"] = speed_windows(recs, wall, pred)
    return rep


def speed_windows(recs, wall, pred, window_s: float = 5.0, min_steps: int = 50) -> list[float]:
    """The run's measured / modelled step time in consecutive `window_s` windows (decode steps only,
    warm-up after idle excluded; windows with fewer than `min_steps` of them left out): how far the
    machine's speed moved within the run. The same step shapes, minutes apart, on this 2-core VM
    ran 0.82-1.29x the model by window (2026-12-05): a run no model can predict to 10% when its
    windows spread that far."""
    from pagedserve.sim.calibration import step_kind, steps_after_idle

    since = steps_after_idle(recs)
    buckets: dict[int, list[float]] = {}
    t0 = recs[0].t_end
    for r, w, p, s in zip(recs, wall, pred, since):
        if step_kind(r) == "decode" and (s is None or s > 4) and p > 0:
            buckets.setdefault(int((r.t_end - t0) // window_s), []).append(w / p)
    return [statistics.median(v) for _, v in sorted(buckets.items()) if len(v) >= min_steps]


def scaled_cost(cost: Path, factor: float):
    """The calibrated constants with every time x factor (the machine `factor` x slower),
    the serving overhead's included (it runs on the same contended CPU)."""
    from dataclasses import replace

    from pagedserve.sim.cost_model import ServingOverhead, load_params

    p = load_params(cost)
    sv = ServingOverhead.from_dict(p.serving)
    sv = replace(sv, admit_s=sv.admit_s * factor, admit_per_prompt_token_s=sv.admit_per_prompt_token_s * factor,
                 deliver_s=sv.deliver_s * factor, deliver_per_output_s=sv.deliver_per_output_s * factor)
    return replace(p, step_overhead_s=p.step_overhead_s * factor, per_request_overhead_s=p.per_request_overhead_s * factor,
                   per_prefill_overhead_s=p.per_prefill_overhead_s * factor,
                   per_output_overhead_s=p.per_output_overhead_s * factor,
                   gemm_mfu=p.gemm_mfu / factor, gemm_mbu=p.gemm_mbu / factor, attn_mfu=p.attn_mfu / factor,
                   attn_mbu=p.attn_mbu / factor, host_bandwidth=p.host_bandwidth / factor, serving=sv.to_dict())


def split_trace(trace: Path, num_probe_lines: int) -> tuple[Path, Path]:
    """The server's one step trace -> the probe's steps and the workload's."""
    lines = trace.read_text().splitlines(keepends=True)
    probe, rest = trace.with_name(trace.stem + ".probe.jsonl"), trace.with_name(trace.stem + ".workload.jsonl")
    probe.write_text("".join(lines[:num_probe_lines]))
    rest.write_text("".join(lines[num_probe_lines:]))
    return probe, rest


def error(sim: float, real: float) -> float | None:
    if real is None or sim is None or math.isnan(real) or math.isnan(sim):
        return None
    if real == 0:
        return 0.0 if sim == 0 else math.inf
    return (sim - real) / real


def fmt_err(e: float | None) -> str:
    if e is None:
        return "n/a"
    if math.isinf(e):
        return "real 0"
    return f"{e:+.1%}"


def table(rows) -> str:
    lines = ["| workload | metric | real: median of runs | real: min–max | simulated | error | simulated at "
             "the probe's speed | error | model error at each run's own speed (median) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for w, real, sim, probe_sim, own_err in rows:
        for key, label, fmt in METRICS:
            values = [r[key] for r in w.runs if not math.isnan(r[key])]
            if not values or (key in ("prefix_hit_rate", "swapped_blocks") and max(values) == 0 and sim[key] == 0):
                continue
            lo, hi = min(values), max(values)
            probe = (f"{fmt.format(probe_sim[key])} | {fmt_err(error(probe_sim[key], real[key]))}"
                     if probe_sim is not None else " | ")
            own = fmt_err(own_err[key]) if own_err is not None and key in own_err else ""
            lines.append(f"| {w.name} | {label} | {fmt.format(real[key])} | {fmt.format(lo)}–{fmt.format(hi)} | "
                         f"{fmt.format(sim[key])} | {fmt_err(error(sim[key], real[key]))} | {probe} | {own} |")
    return "\n".join(lines)


def compare(model: Path, cost: Path, chosen: list[Workload], at_run_speed: bool) -> list[tuple]:
    """Per workload: (workload, real medians, simulated, simulated at the probe's speed (median
    over runs), the model's median error at each run's own speed)."""
    rows = []
    for w in chosen:
        real = {key: statistics.median([r[key] for r in w.runs]) for key, _, _ in METRICS}
        sim = simulate_workload(model, cost, w)
        probe_sim = own_err = None
        if at_run_speed:
            probe_runs, errs = [], {key: [] for key in GOAL_KEYS}
            for r in w.runs:
                probe_runs.append(simulate_workload(model, cost, w, params=scaled_cost(cost, r["probe_over_model"])))
                own = simulate_workload(model, cost, w, params=scaled_cost(cost, r["wall_over_model"]))
                for key in GOAL_KEYS:
                    e = error(own[key], r[key])
                    if e is not None:
                        errs[key].append(e)
            probe_sim = {key: statistics.median(p[key] for p in probe_runs) for key, _, _ in METRICS}
            own_err = {k: statistics.median(v) for k, v in errs.items() if v}
        rows.append((w, real, sim, probe_sim, own_err))
    return rows


def goals_met(rows, which: int = 2) -> tuple[int, int]:
    goals = [error(row[which][k], row[1][k]) for row in rows if row[which] is not None for k in GOAL_KEYS]
    return sum(1 for e in goals if e is not None and abs(e) <= 0.10), len(goals)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="20m", choices=["tiny", "20m", "100m"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results" / "sim_vs_real.json"))
    ap.add_argument("--only", default=None, help="comma list of workload indices (0-based)")
    args = ap.parse_args()

    t_start = time.time()
    model = benchmark_checkpoint(args.size)
    work = Path(args.out).parent / "sim_vs_real"
    work.mkdir(parents=True, exist_ok=True)
    print(f"checkpoint {args.size} at {model}; load average {load_average()}", flush=True)

    all_traces, all_benches, calib_notes = [], [], []
    chosen: list[Workload] = []
    diagnostics: dict[str, list[dict]] = {}
    first_cost = work / "cost_round0.json"
    rate = math.nan
    for rnd in range(args.repeats):
        traces, benches, notes = calibration_round(model, work, rnd)
        all_traces += traces
        all_benches += benches
        calib_notes += notes
        if rnd == 0:
            print(fit_cost(model, traces, benches, first_cost), flush=True)
            rate = rate_for_busy(model, first_cost)
            print(f"request rate for {BUSY_TARGET:.0%} busy (simulated, first calibration): {rate:.3f} req/s", flush=True)
            chosen = workloads(rate)
            if args.only:
                chosen = [chosen[int(i)] for i in args.only.split(",")]
            diagnostics = {w.name: [] for w in chosen}
        for k, w in enumerate(chosen):
            stem = work / f"run{rnd}_{k}"
            trace = stem.with_suffix(".jsonl")
            load0 = load_average()
            with pagedserve_server(model, w.engine, stem.with_suffix(".serve.log"), trace) as server:
                run_bench(server.url, PROBE, stem.with_suffix(".probe.bench.json"), stem.with_suffix(".probe.log"))
                num_probe = len(trace.read_text().splitlines())
                result = run_bench(server.url, w.flags, stem.with_suffix(".bench.json"), stem.with_suffix(".bench.log"))
            probe_trace, trace = split_trace(trace, num_probe)
            m = real_metrics(result)
            held = held_out_step_errors(first_cost, model, trace)
            m["wall_over_model"] = held["wall_over_model"]
            m["busy_fraction"] = held["busy_s"] / result["summary"]["duration_s"]
            w.runs.append(m)
            diagnostics[w.name].append({"round": rnd, "load_before": load0, "load_after": load_average(),
                                        "wall_over_first_model": held["wall_over_model"],
                                        "busy_fraction": m["busy_fraction"],
                                        "step_errors_by_kind": held["by_kind"], "step_errors": held["all"]})
            p99, n_over, n_scrape, by_chance = itl_tail_at_scrapes(result)
            diagnostics[w.name][-1]["itl_gaps_over_p99"] = {"p99_ms": p99 * 1e3, "gaps": n_over,
                                                            "spanning_a_scrape": n_scrape, "by_chance": by_chance}
            print(f"[{rnd}] {w.name}: load {load0} -> {load_average()}; steps x{held['wall_over_model']:.2f} of the "
                  f"first model; busy {m['busy_fraction']:.0%}; "
                  + ", ".join(f"{label} {fmt.format(m[key])}" for key, label, fmt in METRICS)
                  + f"; ITL gaps over the P99: {n_over}, {n_scrape} of them spanning a bench /metrics scrape "
                  f"(by chance ~{by_chance:.1f})",
                  flush=True)

    pooled_cost = work / "cost_pooled.json"
    calib_text = fit_cost(model, all_traces, all_benches, pooled_cost)
    print(calib_text, flush=True)
    for w in chosen:  # each run's speed against the pooled model: its probe's, and its own
        for r, d in zip(w.runs, diagnostics[w.name]):
            stem = work / f"run{d['round']}_{chosen.index(w)}"
            held = held_out_step_errors(pooled_cost, model, stem.with_suffix(".workload.jsonl"))
            probe = held_out_step_errors(pooled_cost, model, stem.with_suffix(".probe.jsonl"))
            r["wall_over_model"], r["probe_over_model"] = held["wall_over_model"], probe["wall_over_model"]
            d.update(wall_over_pooled_model=held["wall_over_model"], probe_over_pooled_model=probe["wall_over_model"],
                     step_errors_by_kind_pooled=held["by_kind"], step_errors_pooled=held["all"])
            d["speed_windows"] = held["speed_windows"]
            sw = held["speed_windows"]
            print(f"[{d['round']}] {w.name}: probe x{probe['wall_over_model']:.2f}, run x{held['wall_over_model']:.2f} "
                  f"of the pooled model (decode steps by 5-s window: "
                  + (f"{min(sw):.2f}-{max(sw):.2f}" if sw else "n/a") + "); held-out per-step error by kind (total time): "
                  + ", ".join(f"{k} {v['total_time_error']:+.1%}" for k, v in held["by_kind"].items()), flush=True)
    rows = compare(model, pooled_cost, chosen, at_run_speed=True)
    rows_first = compare(model, first_cost, chosen, at_run_speed=False)

    print("\nCost model calibrated on all rounds' calibration runs:\n")
    print(table(rows))
    met, total = goals_met(rows)
    met_probe, _ = goals_met(rows, which=3)
    print(f"\n{met} of {total} goal metrics within 10% of the median real run; at the probe's speed {met_probe} of "
          f"{total}")
    first_three = [row for row in rows if row[0].name != "burst into 64 blocks, recompute"]
    met3, total3 = goals_met(first_three)
    own = [e for row in rows for e in (row[4] or {}).values() if e is not None]
    print(f"(the three workloads of the issue's count: {met3} of {total3}; at each run's own speed "
          f"{sum(1 for e in own if abs(e) <= 0.10)} of {len(own)} over all workloads)")
    met1, total1 = goals_met(rows_first)
    print(f"(calibrated once, on round 0 only: {met1} of {total1})")
    for w, real, sim, *_ in rows_first:
        print(f"  {w.name}: " + ", ".join(f"{label} {fmt_err(error(sim[k], real[k]))}"
                                          for k, label, fmt in METRICS if k in GOAL_KEYS))
    print(f"total runtime {time.time() - t_start:.0f} s; load average now {load_average()}")
    Path(args.out).write_text(json.dumps({
        "size": args.size, "calibration": calib_text, "calibration_runs": calib_notes,
        "rate_for_busy": rate,
        "workloads": [{"name": w.name, "engine": w.engine, "flags": w.flags, "real_runs": w.runs,
                       "real_median": real, "sim": sim,
                       "sim_at_probe_speed": probe_sim, "model_error_at_run_speed": own_err,
                       "sim_first_calibration": first[2],
                       "diagnostics": diagnostics[w.name]}
                      for (w, real, sim, probe_sim, own_err), first in zip(rows, rows_first)],
        "goals_met": met, "goals_met_at_probe_speed": met_probe, "goals_total": total,
        "goals_met_first_three": met3, "goals_total_first_three": total3,
        "goals_met_first_calibration": met1}, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
