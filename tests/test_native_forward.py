"""The native forward (pagedserve/model/cpu/decoder.py: the whole Llama forward as one call into
decoder.cpp) against the per-op path on the same model: bit-identical hidden states, logits and
KV pool over chunked-prefill, mixed and decode steps of 1 to 8 requests; taken where it applies
and only there."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.attention import backend_for, cpu_backend
from pagedserve.model.config import read_model_config
from pagedserve.model.cpu import decoder, fused
from pagedserve.model.layers import LINEAR_METHODS
from pagedserve.model.loader import load_model

CPU = torch.device("cpu")
BF16_GEMM = LINEAR_METHODS["cpp"].available(torch.bfloat16, CPU)


@pytest.fixture(autouse=True)
def choices_forgotten(monkeypatch):
    """Each test decides the fused ops and the attention backend afresh (env read once per process)."""
    for env in (fused.FUSED_ENV, "PAGEDSERVE_ATTENTION_BACKEND", "PAGEDSERVE_LINEAR_METHOD", decoder.NATIVE_ENV):
        monkeypatch.delenv(env, raising=False)
    fused.fused_ops_for.cache_clear()
    backend_for.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    fused.fused_ops_for.cache_clear()
    backend_for.cache_clear()


def checkpoint(tmp_path, arch="llama", **shape):
    from checkpoints import make_checkpoint
    dims = dict(hidden=64, heads=4, kv_heads=2, inter=128, layers=2, max_pos=512)
    dims.update(shape)
    return make_checkpoint(tmp_path / arch, arch, **dims)


def load(path, dtype="float32"):
    """The model, its norm weights and biases made random in place (HF initialises them to ones
    and zeros, which would hide a norm or bias read from the wrong layer)."""
    model = load_model(read_model_config(path), dtype, "cpu", max_model_len=512)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return model


def make_steps(rng, num_requests: int, block_size: int, num_blocks: int, vocab: int, window=None):
    """A schedule as the engine makes one: prompts prefilled in chunks (fresh, and after cached
    keys; short ones through the plan, long ones through the tiled paths), then decodes, requests
    skipping steps so a step holds 1..num_requests of them. Yields (decodes, prefills, token ids)."""
    prompts = [int(rng.integers(1, 60)) for _ in range(num_requests)]
    totals = [p + int(rng.integers(1, 6)) for p in prompts]
    need = [-(-t // block_size) for t in totals]
    perm = rng.permutation(num_blocks)
    assert sum(need) <= num_blocks
    starts = np.cumsum([0] + need)
    tables = [perm[starts[i]:starts[i + 1]].astype(np.int64) for i in range(num_requests)]
    done = [0] * num_requests
    while any(d < t for d, t in zip(done, totals)):
        live = [i for i in range(num_requests) if done[i] < totals[i]]
        chosen = [i for i in live if rng.random() < 0.8] or live[:1]
        decodes, prefills = [], []
        for i in chosen:
            if done[i] >= prompts[i]:
                decodes.append((tables[i], done[i]))
                done[i] += 1
            else:
                n = min(prompts[i] - done[i], int(rng.choice([1, 3, 7, 8, 13, 40])))
                prefills.append((tables[i], done[i], n))
                done[i] += n
        num_tokens = len(decodes) + sum(n for _, _, n in prefills)
        yield decodes, prefills, torch.from_numpy(rng.integers(0, vocab, size=num_tokens))


def run_both(model, steps, pool_shape, dtype, block_size, window=None):
    """Each step on the native forward and on the per-op path (the same model with the native
    forward unset), each with its own copy of the pool: asserts hidden states, logits and pools
    equal bit for bit after every step. Returns the number of steps."""
    native = model.native_forward
    assert native is not None, "the native forward was not chosen for a model it serves"
    gen = torch.Generator().manual_seed(1)
    pool_native = (torch.randn(pool_shape, generator=gen) * 0.1).to(dtype)
    pool_ops = pool_native.clone()
    count = 0
    with torch.inference_mode():
        for decodes, prefills, ids in steps:
            outs = []
            for pool, use in ((pool_native, native), (pool_ops, None)):
                model.native_forward = use
                meta, positions = cpu_backend.build_metadata(decodes, prefills, block_size, window, CPU)
                hidden = model(ids, torch.from_numpy(positions), pool, meta)
                outs.append((hidden, model.compute_logits(hidden)))
            model.native_forward = native
            (h_native, l_native), (h_ops, l_ops) = outs
            assert torch.equal(h_native, h_ops), f"step {count}: hidden states differ"
            assert torch.equal(l_native, l_ops), f"step {count}: logits differ"
            assert torch.equal(pool_native, pool_ops), f"step {count}: KV pools differ"
            count += 1
    return count


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("num_requests", [1, 2, 5, 8])
def test_native_equals_per_op_llama(tmp_path, block_size, num_requests):
    model = load(checkpoint(tmp_path))
    cfg = model.cfg
    rng = np.random.default_rng(block_size * 100 + num_requests)
    num_blocks = 8 * 70 // block_size + 8
    steps = make_steps(rng, num_requests, block_size, num_blocks, cfg.vocab_size)
    pool_shape = cfg.kv_cache_shape(num_blocks * block_size)
    before = model.native_forward.num_steps
    n = run_both(model, steps, pool_shape, torch.float32, block_size)
    assert model.native_forward.num_steps - before == n  # every step ran natively


@pytest.mark.parametrize("arch,extra", [
    ("llama", dict(hidden=128, heads=2, kv_heads=1)),                                # head_dim 64, group 2
    ("llama", dict(hidden=128, heads=8, kv_heads=8, attention_bias=True, mlp_bias=True, layers=3)),
    ("qwen2", dict(tie_word_embeddings=True)),                                       # q/k/v bias, tied head
    ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),           # RoPE rows per step
])
def test_native_equals_per_op_shapes(tmp_path, arch, extra):
    model = load(checkpoint(tmp_path, arch, **extra))
    cfg = model.cfg
    rng = np.random.default_rng(7)
    steps = make_steps(rng, 6, 16, 40, cfg.vocab_size)
    assert run_both(model, steps, cfg.kv_cache_shape(40 * 16), torch.float32, 16) > 3


@pytest.mark.skipif(not BF16_GEMM, reason="the cpp GEMM has no bf16 kernel on this CPU")
def test_native_equals_per_op_bf16(tmp_path):
    model = load(checkpoint(tmp_path), "bfloat16")
    cfg = model.cfg
    steps = make_steps(np.random.default_rng(3), 5, 16, 40, cfg.vocab_size)
    assert run_both(model, steps, cfg.kv_cache_shape(40 * 16), torch.bfloat16, 16) > 3


def test_window_chunks_for_sdpa_run_op_by_op(tmp_path):
    """A Mistral window that hides keys from a long chunk sends the chunk to SDPA: that step
    runs op by op (the native path cannot), the others natively, all equal."""
    model = load(checkpoint(tmp_path, "mistral", sliding_window=24))
    cfg = model.cfg
    native = model.native_forward
    blocks = np.arange(8, dtype=np.int64)
    steps = [([], [(blocks, 0, 20)], torch.arange(20)),                 # fresh, the window hides nothing
             ([], [(blocks, 20, 12)], torch.arange(12)),                 # after cached keys, under the window: SDPA
             ([(blocks, 32)], [], torch.tensor([5])),                    # a decode (the plan applies the window)
             ([(blocks, 33)], [], torch.tensor([6]))]
    before = native.num_steps
    assert run_both(model, iter(steps), cfg.kv_cache_shape(8 * 16), torch.float32, 16, window=24) == 4
    assert native.num_steps - before == 3


def test_engine_uses_native_forward_and_matches_hf(tmp_path):
    from checkpoints import greedy_outputs, hf_greedy
    from pagedserve import LLM

    path = checkpoint(tmp_path, layers=3)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(2, 384, size=n)] for n in (1, 9, 40, 17)]
    max_tokens = [10, 6, 8, 12]
    want = hf_greedy(path, prompts, max_tokens)
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=32, max_num_batched_tokens=24)
    assert greedy_outputs(llm, prompts, max_tokens) == want
    native = llm.engine.executor.model.native_forward
    assert native is not None and native.num_steps >= max(max_tokens)


@pytest.mark.parametrize("env,value", [(decoder.NATIVE_ENV, "off"), ("PAGEDSERVE_LINEAR_METHOD", "torch"),
                                       ("PAGEDSERVE_LINEAR_METHOD", "onednn"), (fused.FUSED_ENV, "torch"),
                                       ("PAGEDSERVE_ATTENTION_BACKEND", "torch")])
def test_not_taken_where_a_piece_is_not_ours(tmp_path, choices_forgotten, env, value):
    path = checkpoint(tmp_path)
    assert load(path).native_forward is not None  # the same model, every setting at its default
    choices_forgotten.setenv(env, value)
    fused.fused_ops_for.cache_clear()
    backend_for.cache_clear()
    assert load(path).native_forward is None
    assert decoder.NativeForward.refusal(load(path)) is not None


def test_not_taken_for_moe_or_a_pipeline_stage(tmp_path):
    from pagedserve.model.pipeline import PipelineStage
    moe = load(checkpoint(tmp_path, "mixtral"))
    assert moe.native_forward is None and "layer type" in decoder.NativeForward.refusal(moe)
    path = checkpoint(tmp_path, layers=4)
    cfg = read_model_config(path)
    stage = load_model(cfg, "float32", "cpu", stage=PipelineStage.of(4, 2, 0), max_model_len=512)
    assert stage.native_forward is None


def test_quantized_pool_runs_op_by_op(tmp_path):
    """An fp8 pool is written by kv_quant in torch: the step takes the per-op path."""
    from pagedserve.attention.kv_quant import QuantizedKVCache, kv_format
    model = load(checkpoint(tmp_path))
    pool = QuantizedKVCache.allocate(model.cfg.kv_cache_shape(8 * 16), kv_format("fp8_e4m3"), CPU,
                                     lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
    meta, positions = cpu_backend.build_metadata([], [(np.arange(8), 0, 5)], 16, None, CPU)
    before = model.native_forward.num_steps
    with torch.inference_mode():
        hidden = model(torch.arange(5), torch.from_numpy(positions), pool, meta)
    assert hidden.shape == (5, model.cfg.hidden_size)
    assert model.native_forward.num_steps == before


def test_slot_outside_the_pool_is_refused(tmp_path):
    model = load(checkpoint(tmp_path))
    pool = torch.zeros(model.cfg.kv_cache_shape(4 * 16))
    meta, positions = cpu_backend.build_metadata([(np.array([9]), 3)], [], 16, None, CPU)
    with torch.inference_mode(), pytest.raises(ValueError, match="outside the pool"):
        model(torch.tensor([1]), torch.from_numpy(positions), pool, meta)


def test_unbuildable_loop_warns_and_runs_op_by_op(tmp_path, choices_forgotten, caplog):
    from pagedserve.native import NativeUnavailable

    def unavailable():
        raise NativeUnavailable("no compiler here")
    path = checkpoint(tmp_path)
    choices_forgotten.setattr(decoder, "load_library", unavailable)
    with caplog.at_level("WARNING", logger="pagedserve.model.decoder"):
        model = load(path)
    assert model.native_forward is None
    assert "no compiler here" in caplog.text
