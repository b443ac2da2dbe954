"""CPU of one /metrics render on a server that has served traffic: prometheus_client's
`generate_latest` vs `EngineMetrics.render` (metrics_exposition.py) on the same registry.

A server is built in this process as `pagedserve serve` builds it (sim_vs_real.py's prefix
workload flags: 16 seqs, 256 batched tokens, max_model_len 1024, prefix caching), serves
`--requests` streamed completions (4 shared 384-token prefixes + 32-token suffixes, 32 tokens
out, `--concurrency` at a time), so every histogram family holds observations. Then, with the
server idle, the two renders alternate `--repeats` times on that registry (thread CPU time of
each call: nothing else runs on this thread), and the script prints each one's median and
minimum, whether their texts are byte-identical, and their share of the API event loop at the
bench's scrape interval (render CPU / 0.5 s), beside the loop thread's own CPU per second of
wall time while it served the traffic.

    OMP_NUM_THREADS=1 python benchmarks/metrics_render.py [--metric-names both] [--repeats 300]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import benchmark_checkpoint  # noqa: E402


def thread_cpu_clock(thread: threading.Thread) -> int:
    return time.pthread_getcpuclockid(thread.ident)


def serve_traffic(url: str, model: str, requests: int, concurrency: int, seed: int = 2) -> None:
    import random

    import httpx

    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 300) for _ in range(384)] for _ in range(4)]

    def one(i: int) -> None:
        prompt = prefixes[i % 4] + [rng.randrange(10, 300) for _ in range(32)]
        body = {"model": model, "prompt": prompt, "max_tokens": 32, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                pass

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))


def cpu_of(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.thread_time_ns()
        fn()
        out.append((time.thread_time_ns() - t0) / 1e6)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--metric-names", default="pagedserve", choices=("pagedserve", "vllm", "both"))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--scrape-interval", type=float, default=0.5, help="pagedserve bench's (s)")
    args = p.parse_args()

    from prometheus_client import generate_latest

    from pagedserve.config import EngineConfig
    from pagedserve.server.launcher import ServerThread, build_server

    config = EngineConfig(model=str(benchmark_checkpoint(args.size)), max_num_seqs=16, max_num_batched_tokens=256,
                          max_model_len=1024, kv_cache_memory="64MiB", enable_prefix_caching=True)
    app, async_engine = build_server(config, log_interval=0, metric_names=args.metric_names)
    metrics = async_engine.metrics
    with ServerThread(app) as st:
        loop_clock = thread_cpu_clock(st._thread)
        cpu0, wall0 = time.clock_gettime(loop_clock), time.monotonic()
        serve_traffic(st.url, async_engine.engine.model_name, args.requests, args.concurrency)
        loop_cpu_per_s = (time.clock_gettime(loop_clock) - cpu0) / (time.monotonic() - wall0)
        time.sleep(0.5)  # the last deltas in
        old, new = generate_latest(metrics.registry), metrics.render()
        a, b = [], []
        for _ in range(args.repeats):  # interleaved: the machine's drift falls on both alike
            a += cpu_of(lambda: generate_latest(metrics.registry), 1)
            b += cpu_of(metrics.render, 1)
    load = os.getloadavg()
    lines = old.count(b"\n")
    buckets = sum(1 for line in old.splitlines() if b"_bucket{" in line)
    print(f"--metric-names {args.metric_names}: {lines} lines ({buckets} histogram buckets), "
          f"{args.requests} requests served; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"texts byte-identical: {old == new}")
    print(f"{'render':<28} {'median ms':>10} {'min ms':>8} {'loop share at ' + str(args.scrape_interval) + ' s':>20}")
    for label, xs in (("generate_latest (before)", a), ("EngineMetrics.render (after)", b)):
        med = statistics.median(xs)
        print(f"{label:<28} {med:>10.3f} {min(xs):>8.3f} {med / 1e3 / args.scrape_interval:>19.2%}")
    print(f"ratio before / after (medians): {statistics.median(a) / statistics.median(b):.1f}x")
    print(f"the API loop's thread CPU while serving the traffic: {loop_cpu_per_s:.2f} s per s of wall time")


if __name__ == "__main__":
    main()
