"""The tuning loop end to end on this CPU: tune on the simulator, then measure the real server at
the recommended setting and its two neighbours with `pagedserve bench`.

    python benchmarks/sim_vs_real.py        # once: calibrates results/sim_vs_real/cost_pooled.json (20m, 1 thread)
    python benchmarks/tune_e2e.py

The cost model was fitted with torch on one thread, so the real server runs with one thread too
(OMP_NUM_THREADS=1). Prints simulated and measured throughput / P99 TTFT / P99 ITL for the three
settings and whether each meets the SLO.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common import ROOT, benchmark_checkpoint

ENGINE = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--max-num-batched-tokens", "256",
          "--no-enable-prefix-caching"]


def workload_flags(args) -> list[str]:
    return ["--dataset", "random", "--random-input-len", "256", "--random-output-len", "64",
            "--random-range-ratio", "0.5", "--num-prompts", str(args.num_prompts),
            "--request-rate", str(args.request_rate), "--seed", "7"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(model: Path, seqs: int, args, out_dir: Path) -> dict:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "--log-level", "WARNING", "serve",
                               "--model", str(model), "--port", str(port), "--max-num-seqs", str(seqs), *ENGINE],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        result = out_dir / f"bench_seqs{seqs}.json"
        subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "--base-url", url, *workload_flags(args),
                        "--result-file", str(result), "--disable-tqdm"], check=True, stdout=subprocess.DEVNULL)
        summary = json.loads(result.read_text())["summary"]
        return {"output_throughput": summary["output_throughput"], "p99_ttft_ms": summary["ttft_ms"]["p99"],
                "p99_itl_ms": summary["itl_ms"]["p99"]}
    finally:
        server.terminate()
        server.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cost-model", default=str(ROOT / "results" / "sim_vs_real" / "cost_pooled.json"))
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--slo", nargs=2, default=["ttft_p99:1500", "itl_p99:250"])
    ap.add_argument("--seqs", default="1,2,4,8,16,32")
    args = ap.parse_args()
    if not Path(args.cost_model).exists():
        print(f"no cost model at {args.cost_model}: run benchmarks/sim_vs_real.py first (it calibrates one)")
        return 1
    model = benchmark_checkpoint("20m")
    out_dir = ROOT / "results" / "tune_e2e"
    out_dir.mkdir(parents=True, exist_ok=True)
    tune_json = out_dir / "tune.json"
    subprocess.run([sys.executable, "-m", "pagedserve.cli", "--log-level", "WARNING", "tune", "--device", "cpu",
                    "--model", str(model), "--cost-model", args.cost_model, *ENGINE, *workload_flags(args),
                    "--workload", "random", "--sweep", f"max_num_seqs={args.seqs}", "--slo", *args.slo,
                    "--json", str(tune_json)], check=True)
    tuned = json.loads(tune_json.read_text())
    chosen = tuned["chosen"]["max_num_seqs"]
    grid = [int(s) for s in args.seqs.split(",")]
    i = grid.index(chosen)
    settings = [grid[j] for j in (i - 1, i, i + 1) if 0 <= j < len(grid)]
    slo = {k: float(v) for k, v in (s.split(":") for s in args.slo)}
    sim = {p["knobs"]["max_num_seqs"]: p for p in tuned["simulated"]}
    rows = []
    for seqs in settings:
        real = measure(model, seqs, args, out_dir)
        ok = real["p99_ttft_ms"] <= slo["ttft_p99"] and real["p99_itl_ms"] <= slo["itl_p99"]
        rows.append((seqs, sim[seqs], real, ok))
    print(f"\nSLO: {args.slo}; simulator's sweet spot: max_num_seqs={chosen}")
    print(f"{'max_num_seqs':>13}{'sim tok/s':>11}{'real tok/s':>11}{'sim P99 TTFT':>14}{'real P99 TTFT':>15}"
          f"{'sim P99 ITL':>13}{'real P99 ITL':>14}{'real meets SLO':>16}")
    for seqs, s, r, ok in rows:
        mark = " <= recommended" if seqs == chosen else ""
        print(f"{seqs:>13}{s['output_throughput']:>11.1f}{r['output_throughput']:>11.1f}{s['p99_ttft_ms']:>14.0f}"
              f"{r['p99_ttft_ms']:>15.0f}{s['p99_itl_ms']:>13.0f}{r['p99_itl_ms']:>14.0f}{str(ok):>16}{mark}")
    feasible = [(r["output_throughput"], seqs) for seqs, _, r, ok in rows if ok]
    best = max(feasible)[1] if feasible else None
    print(f"best measured setting meeting the SLO: {best}; recommended: {chosen}")
    (out_dir / "summary.json").write_text(json.dumps({"chosen": chosen, "rows": rows, "best_measured": best},
                                                     indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
