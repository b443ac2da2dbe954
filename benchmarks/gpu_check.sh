#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one prepared run (a lent `device` session has ~15 minutes,
# all tries together). Not part of CI: CI checks the same Triton kernels on CPU in Triton's
# interpreter (tests/test_triton_attention.py). Needs torch with CUDA, triton, and pagedserve's
# dependencies (`pip install -e ".[test]"` where the registries are reachable).
#
#     bash benchmarks/gpu_check.sh 2>&1 | tee gpu_check.log
#
# 1. the Triton kernel tests compiled for the GPU (PAGEDSERVE_TEST_DEVICE=cuda): the kernels
#    against the torch reference and float64 by hand, the backend choice, an engine run vs HF;
# 2. greedy parity on CUDA: pagedserve with the Triton kernels vs HF transformers on the GPU;
# 3. decode throughput on CUDA, Triton kernels vs the torch reference backend, one process each.
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), 'triton', triton.__version__)" || exit 1

echo "== 1. Triton kernel tests on the GPU"
PAGEDSERVE_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -x tests/test_triton_attention.py

echo "== 2. greedy parity with HF on CUDA, 3. throughput per attention backend"
timeout 400 python3 - <<'EOF'
import json, os, subprocess, sys, time
sys.path.insert(0, "benchmarks")
from common import benchmark_checkpoint

path = benchmark_checkpoint("100m")
worker = r'''
import json, os, sys, time, numpy as np, torch
from pagedserve import LLM, SamplingParams
path, backend = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
llm = LLM(path, device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=256)
prompts = [[int(t) for t in rng.integers(10, 30000, size=128)] for _ in range(128)]
sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
torch.cuda.synchronize(); t = time.perf_counter()
outs = llm.generate(prompts, sp, use_tqdm=False)
torch.cuda.synchronize(); dt = time.perf_counter() - t
few = llm.generate(prompts[:8], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
print(json.dumps({"backend": backend, "out_tok_s": 128 * 128 / dt,
                  "greedy": [o.outputs[0].token_ids for o in few]}))
'''
res = {}
for backend in ("triton", "torch"):
    env = dict(os.environ, PAGEDSERVE_ATTENTION_BACKEND=backend)
    r = subprocess.run([sys.executable, "-c", worker, str(path), backend], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(backend, "failed:", r.stderr[-3000:]); continue
    res[backend] = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"{backend}: {res[backend]['out_tok_s']:.0f} output tok/s (128 prompts x 128 new tokens, bf16)")
if len(res) == 2:
    print(f"triton / torch throughput: {res['triton']['out_tok_s'] / res['torch']['out_tok_s']:.2f}x")
# HF on the same GPU, fp32 for a clean reference; bf16 engines may differ at near ties, so report agreement.
import numpy as np, torch
from transformers import AutoModelForCausalLM
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(10, 30000, size=128)] for _ in range(128)][:8]
for backend, got in res.items():
    same = 0
    for p, toks in zip(prompts, got["greedy"]):
        ids = torch.tensor([p], device="cuda")
        out = hf.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, len(p):].tolist()
        same += sum(a == b for a, b in zip(out, toks))
    print(f"{backend} (bf16) vs HF (fp32) greedy: {same} / {8 * 32} tokens equal")
EOF
