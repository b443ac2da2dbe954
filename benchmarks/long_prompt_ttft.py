"""One long prompt's time to first token with chunked prefill: LLM.generate of one prompt of LEN random
ids, max_tokens 1, max_num_batched_tokens BUDGET (so LEN / BUDGET chunks, all but the first after cached
keys), prefix caching off, best of 3 after a warm-up. T threads (default 2).

    python benchmarks/long_prompt_ttft.py /tmp/peers/tiny-llama 2000 256
    PYTHONPATH=/path/to/other/checkout python benchmarks/long_prompt_ttft.py /tmp/peers/small-llama 4000 1024
"""
import sys, time, random, os
import torch
torch.set_num_threads(int(os.environ.get("T", "2")))
from pagedserve import LLM, SamplingParams
import pagedserve
model, plen, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(model=model, dtype="float32", max_model_len=plen + 16, max_num_seqs=4, max_num_batched_tokens=budget,
          num_kv_blocks=(plen // 16 + 4) * 2, enable_prefix_caching=False)
rng = random.Random(0)
sp = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
ts = []
for r in range(4):
    p = {"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(plen)]}
    t = time.perf_counter(); llm.generate([p], sp, use_tqdm=False); ts.append(time.perf_counter() - t)
print(f"{os.path.basename(model)} prompt {plen} budget {budget} ({os.path.dirname(pagedserve.__file__)}): "
      f"TTFT best of 3 {min(ts[1:]) * 1e3:.1f} ms, all {[round(x * 1e3, 1) for x in ts]}")
