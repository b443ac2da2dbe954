"""Two replicas, three routers: kv-aware vs power-of-two vs round-robin on a multi-tenant workload,
measured on loopback through `serve --replicas 2` (Ray Serve) and predicted by
`simulate --replicas 2` (sim/fleet.py) for the same arrivals and token ids.

Workload: TENANTS distinct long prefixes (a system prompt / document each) plus a short unique
suffix, tenants drawn uniformly, Poisson arrivals, streaming. The prefixes together exceed one
replica's KV pool (the ratio is printed) but fit in two: a router that keeps a tenant on one
replica can serve its prefix from cache; one that scatters tenants makes both pools churn.

Model: the built-in default model (4M params, fp32 on CPU), one core per replica. The simulator's
cost model is calibrated first on one in-process engine running the same kind of traffic
(`simulate calibrate` on its step trace), then the fleet's own path is measured by
sim/fleet_probe.py (one replica behind the same application, one request at a time); the
simulator charges both (`sim_engines_only`: the engines alone, as before the probe). Each
replica writes its step and request traces, so the measured TTFT is split into inbound hop,
admission, engine, delivery and outbound hop, and each replica's steps are set against the
cost model's prediction for the same shapes (the second table).

Run: `OMP_NUM_THREADS=1 python benchmarks/replicas.py` (about 5 minutes on a 2-core machine); it
writes benchmarks/data/replicas.json (--out) and prints the tables. `--resim JSON` re-runs only
the simulator against an earlier run's measured rows; `--probe none|FILE` skips the probe.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "pagedserve" / "default_model"
TENANTS, PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN = 8, 256, 16, 16
NUM_REQUESTS, RATE = 64, 2.0
ENGINE = dict(model=str(MODEL), num_kv_blocks=96, block_size=16, max_model_len=512, max_num_seqs=8,
              max_num_batched_tokens=512, enable_prefix_caching=True)
ROUTERS = ("round-robin", "power-of-two", "kv-aware")


def workload():
    from pagedserve.sim.fleet import shared_prefix_workload
    return shared_prefix_workload(TENANTS, PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN, NUM_REQUESTS, RATE, vocab_size=4000,
                                  seed=7)


def calibrate(work: list, out_dir: Path) -> Path:
    """A cost model from one real engine's step trace on this traffic (served one after another
    in bursts, so steps of many shapes appear)."""
    from pagedserve import LLM
    from pagedserve.sampling import SamplingParams

    trace = out_dir / "steps.jsonl"
    with LLM(**ENGINE, step_trace_path=str(trace)) as llm:
        for start in range(0, 32, 8):
            llm.generate([{"prompt_token_ids": w.prompt_token_ids} for w in work[start:start + 8]],
                         SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True, temperature=0), use_tqdm=False)
    cost = out_dir / "cost.json"
    subprocess.run([sys.executable, "-m", "pagedserve.cli", "simulate", "calibrate", "--trace", str(trace),
                    "--model", str(MODEL), "--out", str(cost)], check=True, capture_output=True, text=True)
    return cost


async def one(client, url, model, w, t0, rec):
    await asyncio.sleep(max(0.0, t0 + w.arrival_time - time.monotonic()))
    rec.arrival = time.monotonic() - t0
    body = {"model": model, "prompt": w.prompt_token_ids, "max_tokens": w.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    now = time.monotonic() - t0
                    if rec.first_token_time is None:
                        rec.first_token_time = now
                        rec.server_id = json.loads(line[len("data: "):]).get("id")   # joins the request trace
                    rec.token_times.append(now)
        rec.finish = time.monotonic() - t0
        rec.failed = r.status_code != 200
    except Exception as e:  # noqa: BLE001
        rec.failed, rec.error = True, str(e)


def prefix_counts(url: str) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    q = h = 0.0
    for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=60).text):
        for s in f.samples:
            if s.name == "pagedserve:prefix_cache_queries_total":
                q += s.value
            elif s.name == "pagedserve:prefix_cache_hits_total":
                h += s.value
    return q, h


def per_replica_requests(url: str) -> list[float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=60).text):
        for s in f.samples:
            if s.name == "pagedserve:request_success_total":
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return sorted(out.values())


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def decompose(records: list, t0: float, trace_dir: Path, cost_model) -> dict:
    """Where a measured request's time went, from each replica's request and step traces (one
    clock, time.monotonic, for the client and every replica on this machine): TTFT = inbound hop
    (client -> proxy -> ingress -> router -> replica's HTTP) + admission (body, validation) +
    engine (queue + prefill) + delivery (detokenize, SSE) + outbound hop (the chunk back through
    the ingress and the proxy); and each replica's steps against the cost model's prediction
    for the same shapes."""
    from pagedserve.sim.calibration import read_trace

    server = {}
    for path in trace_dir.glob("*.requests.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                server[row["request_id"]] = row
    parts: dict[str, list[float]] = {k: [] for k in ("inbound", "admit", "engine", "deliver", "outbound_first",
                                                      "outbound_last", "ttft")}
    for rec in records:
        row = server.get(getattr(rec, "server_id", None))
        if row is None or rec.first_token_time is None or not row.get("t_http"):
            continue
        send, first, last = t0 + rec.arrival, t0 + rec.first_token_time, t0 + rec.token_times[-1]
        parts["inbound"].append(row["t_http"] - send)
        parts["admit"].append(row["t_submit"] - row["t_http"])
        parts["engine"].append(row["t_first_token"] - row["t_submit"])
        parts["deliver"].append(row["t_first_out"] - row["t_first_token"])
        parts["outbound_first"].append(first - row["t_first_out"])
        parts["outbound_last"].append(last - row["t_last_out"])
        parts["ttft"].append(first - send)
    out = {"matched": len(parts["ttft"])}
    for k, v in parts.items():
        out[k] = {"p50_ms": _ms(_pct(v, 0.5)), "p99_ms": _ms(_pct(v, 0.99)), "mean_ms": _ms(sum(v) / len(v) if v else None)}
    ratios, stretch, gaps = [], [], []
    for path in trace_dir.glob("*.jsonl"):
        if path.name.endswith(".requests.jsonl"):
            continue
        steps = read_trace(path)
        for prev, st in zip(steps, steps[1:]):
            if st.num_reqs:
                pred = cost_model.predict(st.new_tokens, st.context_lens, st.num_swap_blocks, st.num_outputs)
                if pred > 0:
                    ratios.append(st.step_time / pred)
                if st.cpu_time > 0:
                    stretch.append(st.step_time / st.cpu_time)
                if prev.num_unfinished:
                    gaps.append(st.t_end - prev.t_end)   # the engine's own inter-token time
    out["step_measured_over_predicted"] = {"p50": _pct(ratios, 0.5), "p90": _pct(ratios, 0.9),
                                           "mean": sum(ratios) / len(ratios) if ratios else None}
    out["step_wall_over_cpu"] = {"p50": _pct(stretch, 0.5), "p90": _pct(stretch, 0.9)}
    out["engine_step_gap"] = {"p50_ms": _ms(_pct(gaps, 0.5)), "p99_ms": _ms(_pct(gaps, 0.99))}
    return out


def _ms(x):
    return None if x is None else x * 1e3


def run_real(router: str, work: list, port: int, trace_dir: Path | None = None, cost_model=None) -> dict:
    from pagedserve.bench.report import RequestRecord
    from pagedserve.config import EngineConfig
    from pagedserve.fleet.serve import run_fleet
    from pagedserve.sim.report import compute_metrics

    engine = dict(ENGINE)
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        engine["step_trace_path"] = str(trace_dir / "steps.jsonl")   # each replica writes its own
    run_fleet(EngineConfig(**engine), 2, router, "127.0.0.1", port, blocking=False)
    url = f"http://127.0.0.1:{port}"
    model = httpx.get(url + "/v1/models", timeout=120).json()["data"][0]["id"]
    q0, h0 = prefix_counts(url)
    records = [RequestRecord(str(i), 0.0, w.prompt_len, w.output_len) for i, w in enumerate(work)]

    t0_box = []

    async def drive():
        async with httpx.AsyncClient(timeout=600) as client:
            t0 = time.monotonic()
            t0_box.append(t0)
            await asyncio.gather(*(one(client, url, model, w, t0, r) for w, r in zip(work, records)))

    load0 = os.getloadavg()[0]
    asyncio.run(drive())
    load1 = os.getloadavg()[0]
    time.sleep(3)  # /metrics carries each replica's counters with Ray's routing stats (about 1 s behind)
    q1, h1 = prefix_counts(url)
    replicas = per_replica_requests(url)
    duration = max(r.finish for r in records if r.finish is not None)
    m = compute_metrics(records, duration)
    out = {"prefix_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0, "failed": sum(r.failed for r in records),
           "requests_per_replica": replicas, "load_average": [load0, load1],
           **{k: m[k] for k in ("p50_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "output_throughput")}}
    if trace_dir is not None and cost_model is not None:
        out["breakdown"] = decompose(records, t0_box[0], trace_dir, cost_model)
    return out


def deployment(cost: Path):
    from pagedserve.config import EngineConfig
    from pagedserve.sim.simulator import build_deployment

    cfg = dict(ENGINE)
    return build_deployment(EngineConfig(**cfg), cfg.pop("model"), cost_params=str(cost))


def run_sim(router: str, work: list, cost: Path, probe: Path | None = None) -> dict:
    """The fleet simulator on the same arrivals and ids; with `probe` (sim/fleet_probe.py's fit)
    it charges the fleet's hop and each replica's serving layer as measured there (the
    calibration, from an offline engine, holds neither), else the engines alone."""
    from dataclasses import replace

    from pagedserve.sim.fleet import contention_scale, default_fleet_hop, load_fleet_overhead, probe_serving, simulate_fleet

    extra = {}
    if probe is not None:
        # The engine thread's share of a core in the fleet (the probe's steps) against the
        # calibration run's (its steps, beside the cost model).
        scale = contention_scale(load_fleet_overhead(probe), cost.parent / "steps.jsonl")
        extra = {"hop": replace(default_fleet_hop(probe), step_scale=scale), "serving": probe_serving(probe)}
    result = simulate_fleet(deployment(cost), work, 2, router, **extra)
    m = result.metrics
    out = {"prefix_hit_rate": result.prefix_hit_rate,
           **{k: m[k] for k in ("p50_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "output_throughput")}}
    if probe is not None:
        out["step_scale"] = extra["hop"].step_scale
    return out


def main() -> int:
    import argparse

    import ray
    from ray import serve

    from pagedserve.fleet.serve import free_port

    ap = argparse.ArgumentParser()
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "data" / "replicas.json"))
    ap.add_argument("--probe", default="auto",
                    help="the fleet probe's fit for the simulator: 'auto' (default) measures it just before the "
                         "fleet runs (python -m pagedserve.sim.fleet_probe, about a minute), as the cost model is "
                         "calibrated just before; a FILE it wrote; 'none': the engines alone")
    ap.add_argument("--resim", default=None, metavar="JSON",
                    help="re-run only the simulator against the measured rows (and calibration) of an earlier run's JSON")
    args = ap.parse_args()
    routers = args.routers.split(",")
    probe = None if args.probe in ("none", "auto") else Path(args.probe)
    if probe is not None and not probe.is_file():
        raise SystemExit(f"--probe: {probe} does not exist (python -m pagedserve.sim.fleet_probe --out {probe})")

    work = workload()
    pool_tokens = ENGINE["num_kv_blocks"] * ENGINE["block_size"]
    ratio = TENANTS * PREFIX_LEN / pool_tokens
    print(f"{TENANTS} tenants x {PREFIX_LEN}-token prefixes = {TENANTS * PREFIX_LEN} tokens; one replica's pool "
          f"{pool_tokens} tokens: prefixes / pool = {ratio:.2f} (two pools: {ratio / 2:.2f})", flush=True)
    if args.resim:
        earlier = json.loads(Path(args.resim).read_text())
        cost = Path(earlier["cost"])
        if args.probe == "auto":
            probe = Path(earlier["probe"]) if earlier.get("probe") else None
        rows = {}
        for router, r in earlier["routers"].items():
            rows[router] = {"real": r["real"], "sim": run_sim(router, work, cost, probe)}
            if probe is not None:
                rows[router]["sim_engines_only"] = run_sim(router, work, cost)
        report(rows, probe, ratio, args.out, cost)
        return 0
    out_dir = Path(tempfile.mkdtemp(prefix="replicas-bench-"))
    cost = calibrate(work, out_dir)
    print(f"calibrated: {cost}", flush=True)
    if args.probe == "auto":
        from pagedserve.sim.fleet_probe import measure

        probe = out_dir / "fleet_probe.json"
        probe.write_text(json.dumps(measure(), indent=2))
        print(f"fleet probe: {probe} ({json.loads(probe.read_text())['fit']['source']})", flush=True)
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT)), "OMP_NUM_THREADS": "1"}})
    rows = {}
    try:
        port = free_port()
        model = deployment(cost).cost_model
        for router in routers:
            t = time.monotonic()
            real = run_real(router, work, port, out_dir / router, model)
            sim = run_sim(router, work, cost, probe)
            rows[router] = {"real": real, "sim": sim}
            if probe is not None:
                rows[router]["sim_engines_only"] = run_sim(router, work, cost)
            print(f"{router}: real {real}  sim {sim}  ({time.monotonic() - t:.0f} s)", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    report(rows, probe, ratio, args.out, cost)
    return 0


def report(rows: dict, probe: Path | None, ratio: float, out: str, cost: Path) -> None:
    head = (f"| router | prefix hit rate real / sim | TTFT P50 ms real / sim | TTFT P99 ms real / sim | "
            f"ITL P99 ms real / sim | output tok/s real / sim |\n|---|---|---|---|---|---|")
    lines = [head]
    for router, r in rows.items():
        a, b = r["real"], r["sim"]
        lines.append(f"| {router} | {a['prefix_hit_rate']:.1%} / {b['prefix_hit_rate']:.1%} | "
                     f"{a['p50_ttft_ms']:.0f} / {b['p50_ttft_ms']:.0f} | {a['p99_ttft_ms']:.0f} / {b['p99_ttft_ms']:.0f} | "
                     f"{a['p99_itl_ms']:.0f} / {b['p99_itl_ms']:.0f} | {a['output_throughput']:.1f} / "
                     f"{b['output_throughput']:.1f} |")
    print("\n".join(lines))
    if probe is not None:
        print(f"\nsim: engines + fleet hop + serving layer ({probe.name}); engines alone, as before: "
              + "; ".join(f"{k} TTFT P50/P99 {r['sim_engines_only']['p50_ttft_ms']:.0f}/"
                          f"{r['sim_engines_only']['p99_ttft_ms']:.0f} ms, ITL P99 "
                          f"{r['sim_engines_only']['p99_itl_ms']:.0f} ms" for k, r in rows.items()))
    print("\nwhere a measured TTFT went, P50 / P99 ms (request and step traces of each replica):")
    print("| router | inbound hop | admission | engine (queue + prefill) | delivery | outbound hop (first / last "
          "chunk) | steps measured / predicted (P50, P90) | step wall / CPU (P50, P90) | engine step gap P99 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for router, r in rows.items():
        b = r["real"].get("breakdown")
        if not b:
            continue
        f = lambda k: f"{b[k]['p50_ms']:.1f} / {b[k]['p99_ms']:.1f}" if b[k]["p50_ms"] is not None else "-"  # noqa: E731
        sr, sw = b["step_measured_over_predicted"], b["step_wall_over_cpu"]
        print(f"| {router} | {f('inbound')} | {f('admit')} | {f('engine')} | {f('deliver')} | {f('outbound_first')}, "
              f"{f('outbound_last')} | {sr['p50']:.2f}, {sr['p90']:.2f} | {sw['p50']:.2f}, {sw['p90']:.2f} | "
              f"{b['engine_step_gap']['p99_ms']:.1f} |")
    Path(out).parent.mkdir(exist_ok=True)
    Path(out).write_text(json.dumps(
        {"prefixes_over_one_pool": ratio, "tenants": TENANTS, "prefix_len": PREFIX_LEN, "num_requests": NUM_REQUESTS,
         "rate": RATE, "engine": ENGINE | {"model": "default_model"}, "probe": str(probe) if probe else None,
         "cost": str(cost), "routers": rows}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
