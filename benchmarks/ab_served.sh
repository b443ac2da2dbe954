#!/usr/bin/env bash
# Before/after in one sitting for the renovation's "no slowdown" check (issue 29): in-process 19M at
# 1 sequence and served 246M at 8 and 32 streams, alternating the two checkouts each round, with
# ../shared/peers' own scripts (bench_pagedserve.py, serve_bench.sh -> bench_http.py).
# usage: [CONCS="8 32"] [INPROC=1] benchmarks/ab_served.sh BEFORE_CHECKOUT [ROUNDS]   (checkpoints under /tmp/pagedserve-bench:
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
        python3 -m pagedserve.cli serve --model $M246 --port 8123 --max-model-len 512 --max-num-seqs 32 \
        --no-enable-prefix-caching --kv-cache-memory 2GiB 2>/dev/null | sed "s/^/$side served /")
  done
done
