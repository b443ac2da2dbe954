"""One burst's prefill step, timed: N prompts of 128 random ids added at once, then the one
engine step that prefills them all (max_num_batched_tokens fits the burst), best of --repeats.

    OMP_NUM_THREADS=1 python benchmarks/prefill_step.py --model /tmp/peers/tiny-llama --seqs 32 --threads 1
    python benchmarks/prefill_step.py --model /tmp/peers/small-llama --seqs 16 --threads 2
    python benchmarks/prefill_step.py --model /tmp/peers/tiny-llama --seqs 32 --threads 2 --pool-gib 4

Run it under PYTHONPATH of each checkout to compare two; prints thread CPU and wall ms of the step.
"""
from __future__ import annotations

import argparse
import os
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--pool-gib", type=float, default=None,
                    help="a KV pool of this size (kv_cache_memory) instead of one just big enough: each burst then "
                         "writes blocks never touched before, as a server's does until its pool has been used once")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import pagedserve
    from pagedserve import LLM, SamplingParams

    n, plen = args.seqs, args.prompt_len
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=plen + 16, max_num_seqs=n,
              max_num_batched_tokens=n * plen, enable_prefix_caching=False,
              **({"kv_cache_memory": int(args.pool_gib * 2**30)} if args.pool_gib else
                 {"num_kv_blocks": n * (plen // 16 + 2)}))
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    best_cpu = best_wall = float("inf")
    for r in range(args.repeats + 1):
        for i in range(n):
            engine.add_request(f"r{r}-{i}", [rng.randrange(3, vocab) for _ in range(plen)], params)
        c0, w0 = time.thread_time(), time.perf_counter()
        engine.step()
        c1, w1 = time.thread_time(), time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if r:  # the first is a warm-up
            best_cpu, best_wall = min(best_cpu, c1 - c0), min(best_wall, w1 - w0)
    print(f"{os.path.basename(args.model)} {n}x{plen} {args.dtype} threads {args.threads} "
          f"({os.path.dirname(pagedserve.__file__)}): prefill step thread CPU {best_cpu * 1e3:.1f} ms, "
          f"wall {best_wall * 1e3:.1f} ms (best of {args.repeats}; pool {args.pool_gib or 'just big enough'} GiB); load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
