"""The peers' burst through LLM.generate: 32 prompts of 128 random ids, max_tokens 1, into a pool of
kv_cache_memory 4 GiB (as ../shared/peers/bench_pagedserve.py sizes it), six times; prints each time
(the first is a warm-up). T threads (default 2); run under each checkout's PYTHONPATH to compare.

    python benchmarks/burst_generate.py
    OMP_NUM_THREADS=1 T=1 taskset -c 1 python benchmarks/burst_generate.py /tmp/peers/tiny-llama
"""
import os
import random
import sys
import time

import torch

torch.set_num_threads(int(os.environ.get("T", "2")))
from pagedserve import LLM, SamplingParams  # noqa: E402

model = sys.argv[1] if len(sys.argv) > 1 else "/tmp/peers/tiny-llama"
P = 128
llm = LLM(model=model, dtype="float32", max_model_len=P + 192, max_num_seqs=32, max_num_batched_tokens=4096,
          enable_prefix_caching=False, kv_cache_memory=4 * 2**30)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(P)]} for _ in range(32)]
sp = SamplingParams(max_tokens=1, min_tokens=1, ignore_eos=True, temperature=0.0)
llm.generate(prompts[:1], sp, use_tqdm=False)
times = []
for _ in range(6):
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    times.append(time.perf_counter() - t)
print(f"{os.path.basename(model)} generate 32 x {P}, max_tokens 1, 4 GiB pool, threads {torch.get_num_threads()}: "
      f"{[round(x * 1e3, 1) for x in times]} ms")
