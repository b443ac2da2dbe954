"""MoE and MLA models: greedy output equals HF transformers token for token (fp32), under
chunked prefill, prefix caching and preemption (swap and recompute), on tiny random
checkpoints of Mixtral, Qwen2-MoE and DeepSeek-V3; and the MLA model's real pool is
exactly the pool `pagedserve plan` sizes."""
from __future__ import annotations

import pytest

from checkpoints import HFGreedyReference, greedy_outputs, make_checkpoint, parity_workload
from pagedserve import LLM

ARCHS = {
    "mixtral": dict(),                                    # softmax top-2 of 4, renormalised
    "qwen2_moe": dict(),                                  # top-2 of 8, no renorm, gated shared expert
    "deepseek_v3": dict(),                                # MLA; sigmoid, bias, groups, scaling; 1 dense layer
}
NUM_PROMPTS = 10


_CASES: dict = {}


def _case(arch, tmp_path_factory):
    """Checkpoint, workload and HF reference, built once per architecture for the module."""
    if arch not in _CASES:
        path = make_checkpoint(tmp_path_factory.mktemp(arch), arch, **ARCHS[arch])
        prompts, max_tokens = parity_workload(NUM_PROMPTS)
        _CASES[arch] = (path, prompts, max_tokens, HFGreedyReference(path))
    return _CASES[arch]


@pytest.fixture(scope="module", params=list(ARCHS))
def case(request, tmp_path_factory):
    return _case(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def deepseek_case(tmp_path_factory):
    return _case("deepseek_v3", tmp_path_factory)


def generate(path, prompts, max_tokens, **engine_args):
    llm = LLM(str(path), max_model_len=256, **engine_args)
    return greedy_outputs(llm, prompts, max_tokens), llm


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_parity_under_chunking_prefix_caching_and_preemption(case, mode):
    path, prompts, max_tokens, ref = case
    # 16 blocks of 16 = 256 tokens for 10 prompts of up to 174 tokens: the pool runs dry;
    # a 32-token budget chunks every longer prompt.
    got, llm = generate(path, prompts, max_tokens, num_kv_blocks=16, max_num_batched_tokens=32,
                        preemption_mode=mode, enable_prefix_caching=True, swap_space="16MiB")
    sched = llm.engine.scheduler
    assert sched.total_preemptions > 0 and sched.total_partial_prefills > 0 and sched.kv.prefix_hits > 0
    if mode == "swap":
        assert sched.total_blocks_swapped["in"] > 0
    else:
        assert sched.total_recomputed_tokens > 0
    ref.assert_greedy(prompts, got, max_tokens)


def test_mla_absorbed_prefill_matches_hf(deepseek_case, monkeypatch):
    """The other attention path for prompt chunks: queries absorbed into latent space, the
    heads folded into query rows under a causal or prefix mask (attention/mla.py; the
    default expands the latents for chunks)."""
    path, prompts, max_tokens, ref = deepseek_case
    monkeypatch.setenv("PAGEDSERVE_MLA_PREFILL", "absorb")
    got, llm = generate(path, prompts, max_tokens, num_kv_blocks=16, max_num_batched_tokens=32,
                        preemption_mode="recompute", enable_prefix_caching=True)
    assert llm.engine.scheduler.total_partial_prefills > 0
    ref.assert_greedy(prompts, got, max_tokens)


def test_mla_pool_is_the_latent_and_equals_plans(deepseek_case):
    """The DeepSeek model's pool holds kv_lora_rank + qk_rope_head_dim values per token and
    layer, and its bytes are what `pagedserve plan` computes for the same checkpoint."""
    path, *_ = deepseek_case
    from pagedserve.plan.budget import PlanRequest, compute_plan
    from pagedserve.plan.gpus import custom_gpu
    from pagedserve.plan.models import load_model

    budget = 3 * 2**20
    llm = LLM(str(path), max_model_len=256, kv_cache_memory=budget)
    cfg = llm.engine.model_config
    pool = llm.engine.executor.kv_cache
    assert tuple(pool.shape) == (cfg.num_layers, 1, pool.shape[2], 1, 32 + 8)
    plan = compute_plan(PlanRequest(model=load_model(str(path)), device=custom_gpu(0, "CPU"), device_kind="cpu",
                                    kv_cache_memory=budget, max_model_len=256))
    assert plan.kv_bytes_per_token == cfg.num_layers * (32 + 8) * 4   # fp32 latent + rope key
    assert pool.numel() * pool.element_size() == plan.pool.num_bytes
    assert llm.engine.pool_sizing == plan.pool


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_quantized_kv_cache_is_refused_by_name_for_mla(deepseek_case, kv_cache_dtype):
    """The MLA latent pool is read through the model's own metadata, which knows no quantized
    cache: the engine must refuse the combination, never run it unquantized or misread."""
    path, *_ = deepseek_case
    with pytest.raises(ValueError, match=r"kv_cache_dtype: \S+ is not implemented for the MLA latent cache"):
        LLM(str(path), max_model_len=256, kv_cache_dtype=kv_cache_dtype)
