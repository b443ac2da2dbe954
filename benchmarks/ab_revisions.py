"""Before/after: the same in-process workloads on two checkouts of pagedserve, alternated, one session.

    git worktree add /tmp/before <commit>          # the "before" checkout
    OMP_NUM_THREADS=1 python benchmarks/ab_revisions.py --before /tmp/before [--rounds 3] [--size 20m]

Each trial runs in a fresh process with PYTHONPATH set to one checkout, so each side imports
its own code; trials alternate before/after for `--rounds` rounds, so load drift on a shared
machine hits both alike. Two workloads, both built by the checkout's own benchmark scripts
(their request lists are seeded and identical on both sides):

- offline: `offline_throughput.py`'s requests (prompts 32-512, outputs 16-256, ignore_eos),
  pagedserve only, output tok/s (median of rounds, and each round's after/before ratio);
- chunked: `chunked_prefill.py` as a whole (steady decoders while 1,536-token prompts arrive),
  its steady decoders' median and P99 ITL, chunked and unchunked;
- decode (`--workloads decode`): the peers' workload, `peers_side_by_side.py --_worker` on
  $PEERS_DIR/`--peer-model` (128-token prompts, `--new-tokens` greedy tokens, each batch size of
  `--batch-sizes`), milliseconds per decode step ((total - first token) / (new tokens - 1)).
  E.g. `python benchmarks/ab_revisions.py --before /tmp/before --workloads decode --rounds 8
  --peer-model tiny-llama --batch-sizes 1,8,32 --new-tokens 512`; one pinned core: run it under
  `OMP_NUM_THREADS=1 taskset -c 1` (the trials inherit both).

Use one torch thread on a loaded machine: two threads spin-wait when the cores are shared and
single runs then move by 10x (seen here: 8 s and 89 s for the same 2-thread run).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

OFFLINE = """
import argparse, json, sys, time
sys.path.insert(0, "benchmarks")
from offline_throughput import make_requests, run_pagedserve
from common import benchmark_checkpoint
path = benchmark_checkpoint({size!r})
vocab = json.loads((path / "config.json").read_text())["vocab_size"]
reqs = make_requests({n}, 0, vocab)
args = argparse.Namespace(kv_cache_memory="4GiB", max_num_seqs=64, max_num_batched_tokens=2048)
r = run_pagedserve(path, reqs, args)
print("RESULT", r["output_tokens"] / r["seconds"], r["steps"], r["preemptions"])
"""


def run_side(root: Path, code: list[str], timeout: float) -> str:
    env = dict(os.environ, PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, *code], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{root}: {' '.join(code[:2])} failed:\n{r.stderr[-2000:]}")
    return r.stdout


def offline_trial(root: Path, args) -> dict:
    out = run_side(root, ["-c", OFFLINE.format(size=args.size, n=args.num_requests)], args.timeout)
    tps, steps, preemptions = re.search(r"RESULT (\S+) (\d+) (\d+)", out).groups()
    return {"output_tok_s": float(tps), "steps": int(steps), "preemptions": int(preemptions)}


def chunked_trial(root: Path, args) -> dict:
    out = run_side(root, ["benchmarks/chunked_prefill.py", "--size", args.size], args.timeout)
    got = {}
    for key in ("median_itl_ms", "p99_itl_ms", "output_throughput"):
        m = re.search(rf"^{key}\s+(\S+)\s+(\S+)", out, re.M)
        got[f"chunked_{key}"], got[f"unchunked_{key}"] = float(m.group(1)), float(m.group(2))
    return got


def fmt(value: float) -> str:
    """Milliseconds per step to the microsecond, throughputs to a tenth."""
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"


PEERS_DIR = Path(os.environ.get("PEERS_DIR", "/tmp/peers"))


def decode_trial(root: Path, args) -> dict:
    batch_sizes = args.batch_sizes.split(",")
    os.environ["NEW_TOKENS"] = str(args.new_tokens)  # read by the worker (run_side passes os.environ)
    out = run_side(root, ["benchmarks/peers_side_by_side.py", "--_worker", str(PEERS_DIR / args.peer_model),
                          *batch_sizes], args.timeout)
    got = {}
    for line in out.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            got[f"ms/step bs={d['bs']}"] = 1000 * (d["total_s"] - d["ttft_s"]) / (args.new_tokens - 1)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=Path, help="a checkout of the 'before' revision")
    ap.add_argument("--after", type=Path, default=ROOT, help="default: this checkout")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="20m")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--workloads", default="offline,chunked")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--peer-model", default="tiny-llama", help="decode: a checkpoint under $PEERS_DIR")
    ap.add_argument("--batch-sizes", default="1,8,32", help="decode: running sequences")
    ap.add_argument("--new-tokens", type=int, default=512, help="decode: tokens generated per request")
    args = ap.parse_args()
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    trials = {"offline": offline_trial, "chunked": chunked_trial, "decode": decode_trial}
    chosen = [w for w in args.workloads.split(",") if w]
    print(f"before: {sides['before']}\nafter:  {sides['after']}\nOMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
          f"model {args.peer_model if chosen == ['decode'] else args.size}, {args.rounds} rounds, alternating",
          flush=True)
    results: dict[str, dict[str, list[dict]]] = {w: {"before": [], "after": []} for w in chosen}
    for rnd in range(args.rounds):
        for w in chosen:
            for side in ("before", "after") if rnd % 2 == 0 else ("after", "before"):
                r = trials[w](sides[side], args)
                results[w][side].append(r)
                print(f"[{rnd}] {w} {side}: " + ", ".join(f"{k} {fmt(v)}" for k, v in r.items()), flush=True)
    print(f"\n{'workload / metric':40}{'before':>12}{'after':>12}{'after/before':>14}   (medians of rounds)")
    for w in chosen:
        for key in results[w]["before"][0]:
            b = statistics.median(r[key] for r in results[w]["before"])
            a = statistics.median(r[key] for r in results[w]["after"])
            print(f"{w + ' ' + key:40}{fmt(b):>12}{fmt(a):>12}{(a / b if b else float('nan')):>13.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
