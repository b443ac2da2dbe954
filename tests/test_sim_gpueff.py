"""Issue 31: per-GPU memory efficiency from measured STREAM bandwidth, and the per-kernel launch cost of a
step on a GPU preset. Arithmetic checked by hand against the sourced figures in plan/gpus.py and
sim/cost_params.py."""
from __future__ import annotations

import pytest

from pagedserve.plan.gpus import get_gpu
from pagedserve.plan.models import load_model
from pagedserve.plan.parallel import ParallelLayout
from pagedserve.sim.cost_model import CostModel, CostParams, ModelCost, kernel_count, step_features
from pagedserve.sim.parallel_cost import ParallelCostModel

LLAMA8 = load_model("llama-3.1-8b").shape      # 32 dense layers
MIXTRAL = load_model("mixtral-8x7b").shape     # 32 MoE layers, no shared expert
DS = load_model("deepseek-v3").shape           # 61 MLA layers: 3 dense, 58 MoE with a shared expert


def test_memory_share_is_the_measured_stream_share_relative_to_h100():
    # STREAM Triad (Azure AI-benchmarking-guide): H100 2.97 of 3.35 TB/s, MI300X 4.10 of 5.3, H200 4.15 of 4.8
    h100 = 2.97 / 3.35
    assert CostParams.for_gpu(get_gpu("H100-SXM")).mem_share == 1.0
    assert CostParams.for_gpu(get_gpu("MI300X")).mem_share == pytest.approx(4.10 / 5.3 / h100)
    assert CostParams.for_gpu(get_gpu("H200")).mem_share == pytest.approx(4.15 / 4.8 / h100)
    assert CostParams.for_gpu(get_gpu("A100-80GB")).mem_share == pytest.approx(1.70 / 2.039 / h100)
    # nobody measured these: the datasheet at the stated MBU, as before
    for name in ("L4", "A100-40GB", "B200"):
        assert CostParams.for_gpu(get_gpu(name)).mem_share == 1.0


def test_a_decode_reads_its_weights_at_the_chips_achievable_bandwidth():
    m = ModelCost.from_shape(LLAMA8, "bfloat16", None, 1)
    f = step_features(m, [1], [100])  # one decode: the weight read bounds the GEMMs
    # (H100, H200 and A100-80GB price their GEMMs by a measured curve instead: tests/test_sim_kernels.py;
    # their attention keeps the share)
    for name, share in (("MI300X", 4.10 / 5.3 / (2.97 / 3.35)), ("H200", 4.15 / 4.8 / (2.97 / 3.35))):
        p = CostParams.for_gpu(get_gpu(name))
        bw = get_gpu(name).hbm_bandwidth_gbps * 1e9
        t = CostModel(m, p).breakdown(f)
        if not p.gemm_curve:
            assert t.linear == pytest.approx(m.weight_bytes_per_rank / (bw * share * p.gemm_mbu))
        assert t.attention == pytest.approx(f.attn_bytes / (bw * share * p.attn_mbu))


def test_kernels_per_forward_pass_follow_the_layer_structure():
    # attention block 6 (norm, qkv, rope, cache write, attention, o), dense MLP 4, MoE MLP 8 (+3 shared
    # experts), MLA attention block 11; 5 per step (embedding, final norm, LM head, sampler's two)
    assert kernel_count(LLAMA8) == 32 * (6 + 4) + 5
    assert kernel_count(MIXTRAL) == 32 * (6 + 8) + 5
    assert kernel_count(DS) == 61 * 11 + 3 * 4 + 58 * (8 + 3) + 5
    assert ModelCost.from_shape(LLAMA8, "bfloat16", None, 4).kernels_per_step == 325  # TP: the same kernels


def test_every_step_on_a_gpu_preset_pays_its_kernel_launches():
    m = ModelCost.from_shape(LLAMA8, "bfloat16", None, 1)
    for name, per_kernel in (("H100-SXM", 1.3e-6), ("H200", 1.3e-6), ("MI300X", 3.865e-6)):
        p = CostParams.for_gpu(get_gpu(name))
        assert p.kernel_launch_s == per_kernel
        cm = CostModel(m, p)
        decode = cm.breakdown(step_features(m, [1] * 8, [64] * 8))
        prefill = cm.breakdown(step_features(m, [512], [512]))
        assert decode.launch == pytest.approx(325 * per_kernel) and prefill.launch == decode.launch
        # H100's (and H200's, derived) measured elementwise kernels are a part of their own (0 on a chip without
        # a kernel profile)
        assert decode.total == pytest.approx(decode.linear + decode.attention + decode.overhead + decode.elementwise
                                             + 325 * per_kernel)
        assert (decode.elementwise > 0) == (name in ("H100-SXM", "H200"))
    # nothing scheduled: no forward pass, nothing launched
    assert CostModel(m, CostParams.for_gpu(get_gpu("H100-SXM"))).breakdown(step_features(m, [], [])).launch == 0.0
    # a model with no launch cost (CPU, calibrated): the step as before
    cpu = CostModel(m, CostParams(peak_flops=1e12, mem_bandwidth=1e11))
    assert cpu.breakdown(step_features(m, [1], [64])).launch == 0.0


def test_pipeline_stages_pay_their_own_kernels():
    p = CostParams.for_gpu(get_gpu("H100-SXM"))
    pp = ParallelCostModel(LLAMA8, "bfloat16", None, ParallelLayout(1, 2), p)
    t = pp.breakdown([1], [100])  # one request: one micro-batch, its busier stage the last of two of 16 layers
    assert t.launch == pytest.approx(1.3e-6 * (16 * 10 + 4))  # the last stage: norm, LM head, sampler
    tp1 = ParallelCostModel(LLAMA8, "bfloat16", None, ParallelLayout(1), p).breakdown([1], [100])
    assert tp1.launch == pytest.approx(1.3e-6 * 325)


def test_a_calibrated_model_holds_the_launches_in_its_step_constant_and_keeps_the_chips_share():
    import random

    from pagedserve.core.engine_core import StepTrace
    from pagedserve.plan.kv_budget import ModelShape
    from pagedserve.sim.cost_model import fit

    shape = ModelShape(num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=1, head_dim=4,
                       intermediate_size=16, vocab_size=10)
    m = ModelCost.from_shape(shape, "float32", None, 1)
    unit = dict(peak_flops=1000.0, mem_bandwidth=100.0, mem_share=0.5, kernel_launch_s=1e-3)
    # (a constant weight read is not separable from the step constant: the truth has none, gemm_mbu 0)
    truth = CostModel(m, CostParams(**unit, gemm_mfu=0.3, gemm_mbu=0.0, attn_mfu=0.2, attn_mbu=0.5,
                                    step_overhead_s=0.05, per_request_overhead_s=0.02))
    rng = random.Random(3)
    records = []
    for _ in range(300):
        new = [rng.choice([1, 1, rng.randint(2, 400)]) for _ in range(rng.randint(1, 8))]
        ctx = [k + rng.randint(0, 900) for k in new]
        records.append(StepTrace(new_tokens=new, context_lens=ctx, duration=truth.predict(new, ctx)))
    params, report = fit(records, m, CostParams(**unit))
    assert params.kernel_launch_s == 0.0 and params.mem_share == 0.5
    assert params.attn_mbu == pytest.approx(0.5, rel=0.1)  # against the chip's achievable bandwidth
    fitted = CostModel(m, params)
    for new, ctx in (([1] * 4, [500] * 4), ([300], [300]), ([1, 1, 200], [100, 800, 200])):
        assert fitted.predict(new, ctx) == pytest.approx(truth.predict(new, ctx), rel=0.02)
