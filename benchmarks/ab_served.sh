#!/usr/bin/env bash
# Before/after in one sitting for the renovation's "no slowdown" check (issue 29): in-process 19M at
# 1 sequence and served 246M at 8 and 32 streams, alternating the two checkouts each round, with
# ../shared/peers' own scripts (bench_pagedserve.py, serve_bench.sh -> bench_http.py).
# usage: [CONCS="8 32"] [INPROC=1] [TRACE=DIR] [SERVED_MODEL=/tmp/pagedserve-bench/llama-19m] benchmarks/ab_served.sh BEFORE_CHECKOUT [ROUNDS]
# TRACE=DIR: each server also writes its step trace (--step-trace-path) to DIR, and the end prints, per
#   side, the median tok/s and TTFT per concurrency, and the engine's own step times (steps carrying
#   prompt tokens vs decode-only steps, wall and CPU): a TTFT or tok/s gap with equal step times is
#   the machine, not the engine.   (checkpoints under /tmp/pagedserve-bench:
#   llama-19m = peers' tiny-llama shape, llama-246m = small-llama shape; random weights, fp32)
set -eu
BEFORE=$(cd "$1" && pwd); AFTER=$(cd "$(dirname "$0")/.." && pwd); ROUNDS=${2:-2}
PEERS=${PEERS_SCRIPTS:-$AFTER/../shared/peers}
M19=/tmp/pagedserve-bench/llama-19m; M246=/tmp/pagedserve-bench/llama-246m
# The peers' two shapes (make_models.py), random weights, made once with the installed transformers.
(cd "$AFTER/tests" && python3 -c "
from pathlib import Path; from checkpoints import make_checkpoint
for p, (h, l, a, kv, i) in {'$M19': (256, 4, 4, 2, 688), '$M246': (1024, 16, 16, 4, 2816)}.items():
    if not (Path(p) / 'config.json').exists():
        make_checkpoint(Path(p), 'llama', hidden=h, layers=l, heads=a, kv_heads=kv, inter=i, vocab=32000,
                        max_pos=4096, init_std=0.02, tie_word_embeddings=False)
")
for r in $(seq 1 "$ROUNDS"); do
  for side in before after; do
    root=$BEFORE; [ $side = after ] && root=$AFTER
    echo "# round $r $side $(git -C "$root" rev-parse --short HEAD)"
    if [ "${INPROC:-1}" = 1 ]; then
      (cd "$root" && PYTHONPATH="$root" python3 "$PEERS/bench_pagedserve.py" $M19 1 | sed "s/^/$side inproc /")
    fi
    (cd "$root" && PYTHONPATH="$root" bash "$PEERS/serve_bench.sh" ps-$side 8123 vllm "${CONCS:-8 32}" -- \
        python3 -m pagedserve.cli serve --model ${SERVED_MODEL:-$M246} --port 8123 --max-model-len 512 --max-num-seqs 32 \
        --no-enable-prefix-caching --kv-cache-memory 2GiB ${TRACE:+--step-trace-path $TRACE/$side-r$r.jsonl} \
        2>/dev/null | sed "s/^/$side served /")
  done
done | tee "${TRACE:-/tmp}/ab_served.log"
[ -n "${TRACE:-}" ] && python3 - "$TRACE" <<'PY'
import json, statistics, sys
from pathlib import Path
d = Path(sys.argv[1]); med = statistics.median
runs = {}
for line in open(d / "ab_served.log"):
    if " served {" in line:
        side, _, js = line.split(" ", 2); r = json.loads(js)
        runs.setdefault((side, r["conc"]), []).append(r)
print("side   conc  runs  median tok/s  median mean-TTFT s  median P99-TTFT s")
for (side, conc), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0] != "before")):
    print(f"{side:6} {conc:4} {len(rs):5} {med(r['out_tok_s'] for r in rs):13.1f} "
          f"{med(r['ttft_mean_s'] for r in rs):19.3f} {med(r['ttft_p99_s'] for r in rs):17.3f}")
print("side   steps with prompt tokens: n, mean wall ms, mean cpu ms | decode-only: n, mean wall ms, mean cpu ms")
for side in ("before", "after"):
    steps = [json.loads(l) for f in sorted(d.glob(f"{side}-r*.jsonl")) if not f.name.endswith(".requests.jsonl") for l in open(f)]
    n = lambda s: s["new_tokens"] if isinstance(s["new_tokens"], int) else sum(s["new_tokens"])
    pre = [s for s in steps if n(s) > s["num_outputs"]]; dec = [s for s in steps if n(s) <= s["num_outputs"]]
    row = lambda ss: f"{len(ss):5} {1e3 * sum(s['duration'] for s in ss) / max(1, len(ss)):9.1f} {1e3 * sum(s['cpu_time'] for s in ss) / max(1, len(ss)):9.1f}"
    print(f"{side:6} {row(pre)} | {row(dec)}")
PY
true
