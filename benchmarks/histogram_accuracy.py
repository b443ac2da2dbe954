"""What the Grafana dashboard's quantiles read vs the truth, with vLLM's histogram bounds and with ours.

    python benchmarks/histogram_accuracy.py                 # needs the `prometheus` binary
    python benchmarks/histogram_accuracy.py --num-prompts 24 --request-rate 1

The issue-22 setup, run twice in one invocation (first with vLLM's bounds, then with pagedserve's):
`pagedserve serve` (the built-in model, a pool small enough to preempt often) scraped every 2 s by a
real Prometheus, under `pagedserve bench` with every prompt exactly 200 tokens and every output 300.
After each run the dashboard's own expressions are evaluated over the run's window through
Prometheus' HTTP API, and compared with the truth: TTFT, ITL and E2E from the bench's raw
per-request timings, prompt and output lengths from the requests' usage, tokens per step from the
server's step trace. Only the bucket bounds differ between the two runs (the server runs the
`pagedserve serve` code path; in `--serve` mode this script only swaps the bound layout in).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import ROOT, write_result  # noqa: F401 - puts tests/ on sys.path

JOB = "pagedserve"
QUANTILES = (0.5, 0.9, 0.99)
# (dashboard panel, legend word in its targets, name of the truth series, unit)
ROWS = (("Time to first token", "TTFT", "ttft", "s"), ("Inter-token latency", "ITL", "itl", "s"),
        ("End-to-end request latency", "E2E", "e2el", "s"), ("Prompt length (tokens)", "prompt length", "prompt", ""),
        ("Output length (tokens)", "output length", "output", ""), ("Tokens per step", "tokens per step", "step", ""))


def serve(layout: str, serve_args: list[str]) -> int:
    """`pagedserve serve SERVE_ARGS` with the histogram bounds of `layout` (this process is the server)."""
    import pagedserve.server.launcher as launcher
    from pagedserve.cli import main
    from pagedserve.metrics import BUCKET_LAYOUTS, EngineMetrics

    launcher.EngineMetrics = functools.partial(EngineMetrics, buckets=BUCKET_LAYOUTS[layout])
    return main(["serve", *serve_args])


def dashboard_targets() -> dict[tuple[str, str], str]:
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    return {(p["title"], t["legendFormat"].split()[0]): t["expr"]
            for p in dashboard["panels"] for t in p.get("targets", [])}


def truth(result: dict, trace: Path) -> dict[str, list[float]]:
    ok = [r for r in result["requests"] if r["success"]]
    steps = [json.loads(line)["num_tokens"] for line in trace.read_text().splitlines() if line.strip()]
    return {"ttft": [r["ttft"] for r in ok], "itl": [g for r in ok for g in r["itl"]], "e2el": [r["e2el"] for r in ok],
            "prompt": [r["prompt_len"] for r in ok], "output": [r["output_tokens"] for r in ok],
            "step": [n for n in steps if n > 0]}


def measure(layout: str, args, workdir: Path) -> dict:
    from prometheus_harness import grafana_to_promql, prometheus, run_bench, serving

    trace = workdir / f"steps-{layout}.jsonl"
    serve_args = ["--num-kv-blocks", str(args.num_kv_blocks), "--block-size", "16", "--max-num-seqs",
                  str(args.max_num_seqs), "--max-model-len", "512", "--step-trace-path", str(trace),
                  "--log-interval", "0", "--uvicorn-log-level", "warning"]
    command = [sys.executable, str(Path(__file__).resolve()), "--serve", layout, "--"]
    bench_args = ["--dataset", "random", "--num-prompts", str(args.num_prompts), "--random-input-len", "200",
                  "--random-output-len", "300", "--random-range-ratio", "0", "--request-rate", str(args.request_rate),
                  "--seed", str(args.seed), "--no-metrics"]
    with serving(serve_args, workdir, command=command) as server, \
            prometheus({JOB: server}, workdir, scrape_interval_s=2.0) as prom:
        start = prom.wait_scrapes_after(JOB, 0.0, count=2)
        t0 = time.time()
        result = run_bench(server, bench_args, workdir / f"bench-{layout}.json", timeout_s=3600)
        bench_s = time.time() - t0
        end = prom.wait_scrapes_after(JOB, time.time(), count=2)
        window = end - start + 2.0
        targets = dashboard_targets()
        read = {}
        for title, _, name, _ in ROWS:
            for legend in [f"P{q * 100:g}" for q in QUANTILES] + ["mean"]:
                values = prom.values(grafana_to_promql(targets[(title, legend)], window), at=end)
                read[f"{name} {legend}"] = values[0] if values else math.nan
        preemptions = prom.scalar("sum(pagedserve:num_preemptions_total)", at=end)
    series = truth(result, trace)
    true = {}
    for name, values in series.items():
        for q in QUANTILES:
            true[f"{name} P{q * 100:g}"] = float(np.percentile(values, 100 * q))
        true[f"{name} mean"] = float(np.mean(values))
    return {"read": read, "true": true, "bench_s": bench_s, "preemptions": preemptions,
            "requests": result["summary"]["successful_requests"]}


def print_table(runs: dict[str, dict]) -> None:
    ours, theirs = runs["pagedserve"], runs["vllm"]
    print(f"\n{'':16}{'':6}{'true (vLLM run)':>16}{'vLLM bounds':>13}{'err':>8}{'true (our run)':>16}"
          f"{'our bounds':>12}{'err':>8}")
    for _, label, name, unit in ROWS:
        scale, fmt = (1000.0, ".1f") if unit == "s" else (1.0, ".1f")
        shown = f"{label} (ms)" if unit == "s" else label
        for legend in [f"P{q * 100:g}" for q in QUANTILES] + ["mean"]:
            key = f"{name} {legend}"
            cells = []
            for run in (theirs, ours):
                t, r = run["true"][key], run["read"][key]
                cells += [format(t * scale, fmt), format(r * scale, fmt), f"{(r / t - 1) * 100:+.0f}%" if t else "n/a"]
            print(f"{shown:16}{legend:6}{cells[0]:>16}{cells[1]:>13}{cells[2]:>8}{cells[3]:>16}{cells[4]:>12}{cells[5]:>8}")
            shown = ""


def main() -> None:
    if "--serve" in sys.argv:
        i = sys.argv.index("--serve")
        sys.exit(serve(sys.argv[i + 1], sys.argv[sys.argv.index("--") + 1:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--request-rate", type=float, default=2.0)
    ap.add_argument("--num-kv-blocks", type=int, default=128, help="blocks of 16: a request needs 32")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from prometheus_harness import prometheus_binary

    if prometheus_binary() is None:
        sys.exit("histogram_accuracy: needs the `prometheus` binary (Debian/Ubuntu: apt-get install -y prometheus)")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="histogram-accuracy-") as tmp:
        for layout in ("vllm", "pagedserve"):
            runs[layout] = measure(layout, args, Path(tmp))
            r = runs[layout]
            print(f"{layout} bounds: {r['requests']} requests in {r['bench_s']:.0f} s, "
                  f"{r['preemptions']:.0f} preemptions", flush=True)
    print_table(runs)
    path = write_result("histogram_accuracy", {"args": vars(args), "runs": runs})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
