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
wall time while it served the traffic. Last, the loop thread's CPU per whole `GET /metrics`
(HTTP, route and render), in blocks of 20 scrapes alternating the two renders.

    OMP_NUM_THREADS=1 python benchmarks/metrics_render.py [--metric-names both] [--repeats 300]

`--tail-ab OLD_TREE` instead runs sim_vs_real.py's prefix workload (20m checkpoint) as a user
would, `pagedserve serve` + `pagedserve bench` (which scrapes /metrics every 0.5 s), against a
server from OLD_TREE (a checkout before this change, e.g. /work/main) and one from this tree,
interleaved `old new old new ...` (`--rounds` pairs), and prints per run the P99 ITL, how many
inter-token gaps lie above it, how many of those span the start of a scrape, and how many
would by chance (sim_vs_real.itl_tail_at_scrapes), with the load average before and after.

`--callgrind-renders N --renderer old|new` builds the same registry without a model (the
server's settings, synthetic traffic through the record_* calls the API loop makes), renders
it N times and exits: for instruction counts that no other job's load moves, run it under
`valgrind --tool=callgrind` with N = 0 and N = 20 and take the difference / 20.
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


def tail_ab(old_tree: Path, rounds: int, out_dir: Path) -> None:
    from live import ROOT, Server, env, free_port, load_average, run_bench
    from sim_vs_real import itl_tail_at_scrapes, workloads

    prefix = workloads(1.0)[1]
    model = benchmark_checkpoint("20m")
    out_dir.mkdir(parents=True, exist_ok=True)
    trees = {"old": old_tree.resolve(), "new": ROOT}
    print(f"prefix workload: serve {' '.join(prefix.engine)}; bench {' '.join(prefix.flags)}")
    print(f"old = {trees['old']}, new = {trees['new']}")
    for rnd in range(rounds):
        for label in ("old", "new"):
            stem = out_dir / f"tail_{rnd}_{label}"
            port = free_port()
            cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model), "--port", str(port),
                   "--uvicorn-log-level", "warning", "--log-interval", "0", *prefix.engine]
            load0 = load_average()
            with Server(cmd, port, stem.with_suffix(".serve.log"), env(1, {"PYTHONPATH": str(trees[label])})) as srv:
                result = run_bench(srv.url, prefix.flags, stem.with_suffix(".bench.json"), stem.with_suffix(".log"))
            p99, n_over, spanning, by_chance = itl_tail_at_scrapes(result)
            print(f"[{rnd}] {label}: load {load0} -> {load_average()}; P99 ITL {p99 * 1e3:.1f} ms; "
                  f"gaps over it {n_over}, {spanning} spanning a scrape start (by chance {by_chance:.1f}); "
                  f"output {result['summary'].get('output_throughput', float('nan')):.1f} tok/s", flush=True)


def synthetic_renders(names: str, renderer: str, n: int) -> None:
    import random

    from prometheus_client import generate_latest

    from pagedserve.core.outputs import RequestMetrics, SchedulerStats
    from pagedserve.metrics import EngineMetrics

    m = EngineMetrics("model", 1024, log_interval=0, max_num_batched_tokens=256, names=names)
    m.set_cache_config("float32", 16, 4096, 8192, "cpu")
    rng = random.Random(1)
    for _ in range(100):
        tokens = rng.randint(1, 256)
        m.record_step(SchedulerStats(num_batched_tokens=tokens), duration=rng.expovariate(150), forward_time=0.005,
                      num_batched_tokens=tokens)
        m.record_first_token(416, 100.0, 100.0 + rng.expovariate(30))
        m.record_new_tokens(1, None)
        m.record_new_tokens(2, rng.expovariate(150))
        m.record_finished("length", 416, 32, RequestMetrics(
            arrival_time=100.0, first_scheduled_time=100.0 + rng.expovariate(500), first_token_time=100.03,
            last_token_time=100.3, finished_time=100.3 + rng.expovariate(5), num_preemptions=0, num_cached_tokens=384))
    render = (lambda: generate_latest(m.registry)) if renderer == "old" else m.render
    render()
    for i in range(n):
        m.record_new_tokens(1, rng.expovariate(150))  # values move between scrapes
        render()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--metric-names", default="pagedserve", choices=("pagedserve", "vllm", "both"))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--scrape-blocks", type=int, default=10)
    p.add_argument("--scrape-interval", type=float, default=0.5, help="pagedserve bench's (s)")
    p.add_argument("--tail-ab", type=Path, metavar="OLD_TREE", help="the interleaved tail A/B (see the docstring)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/metrics_render"))
    p.add_argument("--callgrind-renders", type=int, default=None, metavar="N")
    p.add_argument("--renderer", choices=("old", "new"), default="new")
    args = p.parse_args()
    if args.callgrind_renders is not None:
        synthetic_renders(args.metric_names, args.renderer, args.callgrind_renders)
        return
    if args.tail_ab is not None:
        tail_ab(args.tail_ab, args.rounds, args.out_dir)
        return

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
        # A whole scrape as the loop sees it (HTTP in and out, the route, the render), still idle:
        # the loop thread's CPU per GET /metrics, blocks of scrapes alternating the two renders.
        import httpx

        scrape_cpu = {"before": [], "after": []}
        fast = metrics.render
        with httpx.Client(base_url=st.url) as http:
            for _ in range(args.scrape_blocks):
                for label, render in (("before", lambda: generate_latest(metrics.registry)), ("after", fast)):
                    metrics.render = render  # the route calls metrics.render()
                    cpu0 = time.clock_gettime(loop_clock)
                    for _ in range(20):
                        http.get("/metrics").raise_for_status()
                    scrape_cpu[label].append((time.clock_gettime(loop_clock) - cpu0) / 20 * 1e3)
        metrics.render = fast
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
    print("the API loop's thread CPU per GET /metrics (idle server; median of "
          f"{args.scrape_blocks} blocks of 20): before {statistics.median(scrape_cpu['before']):.3f} ms, "
          f"after {statistics.median(scrape_cpu['after']):.3f} ms")


if __name__ == "__main__":
    main()
