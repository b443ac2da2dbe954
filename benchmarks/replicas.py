"""Two replicas, three routers: kv-aware vs power-of-two vs round-robin on a multi-tenant workload,
measured on loopback through `serve --replicas 2` (Ray Serve) and predicted by
`simulate --replicas 2` (sim/fleet.py) for the same arrivals and token ids.

Workload: TENANTS distinct long prefixes (a system prompt / document each) plus a short unique
suffix, tenants drawn uniformly, Poisson arrivals, streaming. The prefixes together exceed one
replica's KV pool (the ratio is printed) but fit in two: a router that keeps a tenant on one
replica can serve its prefix from cache; one that scatters tenants makes both pools churn.

Model: the built-in default model (4M params, fp32 on CPU), one core per replica. The simulator's
cost model is calibrated first on one in-process engine running the same kind of traffic
(`simulate calibrate` on its step trace). Run: `python benchmarks/replicas.py` (about 10 minutes
on a 2-core machine); it writes benchmarks/data/replicas.json and prints the table.
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


def run_real(router: str, work: list, port: int) -> dict:
    from pagedserve.bench.report import RequestRecord
    from pagedserve.config import EngineConfig
    from pagedserve.fleet.serve import run_fleet
    from pagedserve.sim.report import compute_metrics

    run_fleet(EngineConfig(**ENGINE), 2, router, "127.0.0.1", port, blocking=False)
    url = f"http://127.0.0.1:{port}"
    model = httpx.get(url + "/v1/models", timeout=120).json()["data"][0]["id"]
    q0, h0 = prefix_counts(url)
    records = [RequestRecord(str(i), 0.0, w.prompt_len, w.output_len) for i, w in enumerate(work)]

    async def drive():
        async with httpx.AsyncClient(timeout=600) as client:
            t0 = time.monotonic()
            await asyncio.gather(*(one(client, url, model, w, t0, r) for w, r in zip(work, records)))

    asyncio.run(drive())
    time.sleep(3)  # /metrics carries each replica's counters with Ray's routing stats (about 1 s behind)
    q1, h1 = prefix_counts(url)
    replicas = per_replica_requests(url)
    duration = max(r.finish for r in records if r.finish is not None)
    m = compute_metrics(records, duration)
    return {"prefix_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0, "failed": sum(r.failed for r in records),
            "requests_per_replica": replicas,
            **{k: m[k] for k in ("p50_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "output_throughput")}}


def run_sim(router: str, work: list, cost: Path) -> dict:
    from pagedserve.config import EngineConfig
    from pagedserve.sim.fleet import simulate_fleet
    from pagedserve.sim.simulator import build_deployment

    cfg = dict(ENGINE)
    dep = build_deployment(EngineConfig(**cfg), cfg.pop("model"), cost_params=str(cost))
    result = simulate_fleet(dep, work, 2, router)
    m = result.metrics
    return {"prefix_hit_rate": result.prefix_hit_rate,
            **{k: m[k] for k in ("p50_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "output_throughput")}}


def main() -> int:
    import ray
    from ray import serve

    from pagedserve.fleet.serve import free_port

    work = workload()
    pool_tokens = ENGINE["num_kv_blocks"] * ENGINE["block_size"]
    ratio = TENANTS * PREFIX_LEN / pool_tokens
    print(f"{TENANTS} tenants x {PREFIX_LEN}-token prefixes = {TENANTS * PREFIX_LEN} tokens; one replica's pool "
          f"{pool_tokens} tokens: prefixes / pool = {ratio:.2f} (two pools: {ratio / 2:.2f})", flush=True)
    out_dir = Path(tempfile.mkdtemp(prefix="replicas-bench-"))
    cost = calibrate(work, out_dir)
    print(f"calibrated: {cost}", flush=True)
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT)), "OMP_NUM_THREADS": "1"}})
    rows = {}
    try:
        port = free_port()
        for router in ROUTERS:
            t = time.monotonic()
            real = run_real(router, work, port)
            sim = run_sim(router, work, cost)
            rows[router] = {"real": real, "sim": sim}
            print(f"{router}: real {real}  sim {sim}  ({time.monotonic() - t:.0f} s)", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
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
    (ROOT / "benchmarks" / "data").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "data" / "replicas.json").write_text(json.dumps(
        {"prefixes_over_one_pool": ratio, "tenants": TENANTS, "prefix_len": PREFIX_LEN, "num_requests": NUM_REQUESTS,
         "rate": RATE, "engine": ENGINE | {"model": "default_model"}, "routers": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
