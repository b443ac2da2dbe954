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
# 3. decode throughput on CUDA, Triton kernels vs the torch reference backend, one process each, and
#    the batch-1 decode step's bandwidth use (benchmarks/gpu_engine_check.py);
# 4. the simulator's GPU preset against a measured 8B-shaped forward (benchmarks/gpu_step_probe.py; its
#    `compare` half runs anywhere on the JSON this writes).
# GPU_CHECK_OUT: the folder the JSON results go to (default /tmp). Runs from the checkout without an
# install: the checkout goes on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), 'triton', triton.__version__)" || exit 1

echo "== 1. Triton kernel tests on the GPU"
PAGEDSERVE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py

echo "== 2. greedy parity with HF on CUDA, 3. throughput and bandwidth use per attention backend"
timeout 220 python3 benchmarks/gpu_engine_check.py --out "${GPU_CHECK_OUT:-/tmp}/gpu_engine_check.json"

echo "== 4. a Llama-3.1-8B-shaped forward timed part by part (the simulator's GPU preset checked against it)"
timeout 180 python3 benchmarks/gpu_step_probe.py measure --out "${GPU_CHECK_OUT:-/tmp}/gpu_step_probe.json"
