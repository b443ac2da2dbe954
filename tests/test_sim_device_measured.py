"""Issue 31: device terms taken from measured kernel figures (Azure AI-benchmarking-guide result files, as cited in
plan/gpus.py): MI300X's fp8 GEMM, the NCCL/RCCL all-reduce bus bandwidth by message size above vLLM's custom
all-reduce limit, and A100's FlashAttention-2 rate. Expected values are worked by hand from those figures."""
from __future__ import annotations

import math

import pytest

from pagedserve.plan.gpus import get_gpu
from pagedserve.plan.kv_budget import ModelShape
from pagedserve.plan.models import load_model
from pagedserve.plan.parallel import ParallelLayout
from pagedserve.sim.cost_model import CostModel, CostParams, ModelCost, step_features
from pagedserve.sim.parallel_cost import ParallelCostModel

# Llama-3.1-405B's config (huggingface.co/meta-llama/Llama-3.1-405B): 126 layers, hidden 16384
L405 = ModelShape(num_layers=126, hidden_size=16384, num_attention_heads=128, num_kv_heads=8, head_dim=128,
                  intermediate_size=53248, vocab_size=128256)
QWEN_LIKE = load_model("llama-3.1-8b").shape
MiB = 2**20


def test_mi300x_fp8_gemms_run_at_the_measured_hipblaslt_fp8_share():
    # hipBLASLt FP8 8192^3: 1,222.9 of 2,614.9 TFLOP/s; relative to H100's MAMF share 1,402.6 / 1,979
    p = CostParams.for_gpu(get_gpu("MI300X"))
    assert p.fp8_matmul_share == pytest.approx(1222.9 / 2614.9 / (1402.6 / 1979))
    assert p.matmul_share == pytest.approx(668.4 / 1307.4 / (794.5 / 989))  # bf16 unchanged


def test_tp8_all_reduces_from_8_mib_up_take_the_measured_rccl_bus_bandwidth():
    p = CostParams.for_gpu(get_gpu("MI300X"))
    cm = ParallelCostModel(L405, "fp8", None, ParallelLayout(8), p)
    ring = 2 * 7 / 8
    # 256 decodes: 256 x 16384 x 2 bytes = 8 MiB a message, not below the custom kernel's 8 MiB limit: RCCL's
    # measured 131.57 GB/s at 8 MiB, 2 x 126 all-reduces
    t = cm.breakdown([1] * 256, [200] * 256)
    assert t.allreduce == pytest.approx(252 * ring * 8 * MiB / 131.57e9)
    # 128 decodes (4 MiB): the custom kernel, as before: the link's 448 GB/s x 0.7 plus 8 us each
    t = cm.breakdown([1] * 128, [200] * 128)
    assert t.allreduce == pytest.approx(252 * (ring * 4 * MiB / (896e9 / 2 * 0.7) + 8e-6))
    # 384 tokens = 12 MiB: log-log between 8 MiB (131.57) and 16 MiB (171.46)
    bw = math.exp(math.log(131.57) + math.log(1.5) / math.log(2) * math.log(171.46 / 131.57)) * 1e9
    t = cm.breakdown([384], [384])
    assert t.allreduce == pytest.approx(252 * ring * 12 * MiB / bw)
    # beyond the largest measured size: the 8 GiB figure
    assert t.allreduce > 0 and cm.breakdown([300_000], [300_000]).allreduce == pytest.approx(
        252 * ring * 300_000 * 16384 * 2 / 316.82e9)


def test_the_measured_curve_is_for_eight_gpus_only_and_a_chip_without_one_keeps_the_link_model():
    ring4 = 2 * 3 / 4
    mi = ParallelCostModel(L405, "fp8", None, ParallelLayout(4), CostParams.for_gpu(get_gpu("MI300X")))
    assert mi.breakdown([1024], [1024]).allreduce == pytest.approx(
        252 * (ring4 * 1024 * 16384 * 2 / (896e9 / 2 * 0.7) + 8e-6))  # 32 MiB at TP 4: not measured
    l4 = ParallelCostModel(L405, "fp8", None, ParallelLayout(8), CostParams.for_gpu(get_gpu("L4")))
    assert l4.breakdown([1024], [1024]).allreduce == pytest.approx(
        252 * (2 * 7 / 8 * 1024 * 16384 * 2 / (32e9 / 2 * 0.7) + 8e-6))  # no L4 curve at hand
    # H100 at TP 8, 32 MiB: NCCL's 295.53 GB/s (the "33M" row is 2^25 bytes)
    h100 = ParallelCostModel(L405, "fp8", None, ParallelLayout(8), CostParams.for_gpu(get_gpu("H100-SXM")))
    assert h100.breakdown([1024], [1024]).allreduce == pytest.approx(252 * 2 * 7 / 8 * 32 * MiB / 295.53e9)
    # the single-engine CostModel prices its all-reduces the same way
    p = CostParams.for_gpu(get_gpu("MI300X"))
    m = ModelCost.from_shape(L405, "fp8", None, 8)
    t = CostModel(m, p).breakdown(step_features(m, [256], [256]))
    assert t.allreduce == pytest.approx(252 * 2 * 7 / 8 * 8 * MiB / 131.57e9)


def test_a100_prefill_attention_computes_at_the_measured_flashattention2_rate():
    # FA2 forward on A100-SXM4-80GB: 179.5 TFLOP/s; the 40 GB part has the same compute
    for name in ("A100-80GB", "A100-40GB"):
        p = CostParams.for_gpu(get_gpu(name))
        m = ModelCost.from_shape(QWEN_LIKE, "bfloat16", None, 1)
        f = step_features(m, [2048], [32000])  # a chunk after a long prefix: compute-bound attention
        t = CostModel(m, p).breakdown(f)
        assert t.attention == pytest.approx(f.attn_flops / 179.5e12)
    # Hopper keeps the stated share of its datasheet (vLLM runs FA3 there; no FA3 figure at hand)
    assert CostParams.for_gpu(get_gpu("H100-SXM")).attn_mfu == 0.4
