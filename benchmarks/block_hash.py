"""Cost of keying one full KV block for the prefix cache: the old key (Python's builtin
hash of (parent, token tuple)) vs the current one (SHA-256 of the parent key + the token ids
packed as int64), and the manager's whole per-block path (keying plus the bookkeeping the
lookup verification needs), side by side in one run.

    python benchmarks/block_hash.py                  # block size 16, 64k blocks
    python benchmarks/block_hash.py --block-size 32

Context for the absolute numbers: a block is keyed once per request that fills it, i.e.
once per `block_size` prompt or output tokens, next to a forward pass over those tokens.
"""
from __future__ import annotations

import argparse
import random
import time

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache import KVCacheManager, block_content, chain_hash
from pagedserve.core.request import Request
from pagedserve.sampling import SamplingParams


def old_keys(tokens: list[int], bs: int) -> list[int]:
    keys: list[int] = []
    parent = None
    for i in range(len(tokens) // bs):
        parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
        keys.append(parent)
    return keys


def new_keys(tokens: list[int], bs: int) -> list[bytes]:
    keys: list[bytes] = []
    parent = None
    for i in range(len(tokens) // bs):
        parent = chain_hash(parent, block_content(tokens[i * bs:(i + 1) * bs]))
        keys.append(parent)
    return keys


def manager_path(tokens: list[int], bs: int) -> None:
    """get_computed_blocks on an empty cache: keys every full block and looks each one up."""
    kv = KVCacheManager(BlockPool(1, enable_caching=True), bs)
    kv.get_computed_blocks(Request("r", tokens + [0], SamplingParams(max_tokens=1)))


def best_seconds(fn, *args, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=65536)
    ap.add_argument("--vocab", type=int, default=152064)
    args = ap.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(args.vocab) for _ in range(args.block_size * args.num_blocks)]
    # the manager path on one long request would be one prefix; cut it into 2k-token prompts
    prompts = [tokens[i:i + 2048] for i in range(0, len(tokens), 2048)]
    runs = {
        "old: builtin hash((parent, tuple))": lambda: old_keys(tokens, args.block_size),
        "new: sha256(parent + int64 tokens)": lambda: new_keys(tokens, args.block_size),
        "new: manager lookup path per block": lambda: [manager_path(p, args.block_size) for p in prompts],
    }
    per_block = {name: best_seconds(fn) / args.num_blocks for name, fn in runs.items()}
    base = per_block["old: builtin hash((parent, tuple))"]
    print(f"block_size={args.block_size}, {args.num_blocks} blocks, best of 5")
    for name, seconds in per_block.items():
        ratio = f"{seconds / base:5.2f}x old" if "manager" not in name else "(no old counterpart: includes lookups)"
        print(f"  {name:40s} {seconds * 1e6:7.3f} us/block   {ratio}")


if __name__ == "__main__":
    main()
