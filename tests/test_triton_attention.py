"""The Triton paged-attention kernels (attention/triton_backend) against the torch reference and
attention computed by hand in float64, from the same pool: decodes, prefill chunks with and
without a cached prefix (one tile and several), GQA / MHA / MQA, head dims that are not powers
of two, sliding windows, block tables with holes, shuffled ids and stale ids past the context,
contexts that end mid-block, fp32 / bf16 / fp16 caches; the KV write and its padding slots;
the bounds check; the backend choice and its fallback; and one engine run against HF.

Where: on CPU (CI) the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here
before the kernels are defined), so shapes stay small. PAGEDSERVE_TEST_DEVICE=cuda runs the
same tests compiled on a GPU (benchmarks/gpu_check.sh). They skip, saying so, only when triton
cannot be imported at all.
"""
from __future__ import annotations

import logging
import os
import sys

import numpy as np
import pytest
import torch

DEVICE = torch.device(os.environ.get("PAGEDSERVE_TEST_DEVICE", "cpu"))

try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - CI installs triton with the test extra
    pytest.skip(f"triton cannot be imported ({e}): the Triton kernels are not checked", allow_module_level=True)


def _load_backend():
    """triton_backend, its kernels interpreted on CPU (conftest sets TRITON_INTERPRET=1 before
    triton is first imported: triton's own library functions are fixed at that import)."""
    from pagedserve.attention import triton_backend
    from pagedserve.attention.triton_check import interpreted

    if DEVICE.type == "cpu" and not interpreted(triton.language.standard.zeros):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it): its kernels "
                    "cannot run on CPU in this process", pytrace=False)
    return triton_backend


triton_backend = _load_backend()

from pagedserve import attention  # noqa: E402
from pagedserve.attention import torch_backend, triton_check  # noqa: E402
from test_attention_kernels import (TOL, hand_attention, kv_views, make_step, pools_after_write,  # noqa: E402
                                    step_inputs)


def run(backend, step, q, k, v, k_cache, v_cache, block_size, window, scale):
    meta, positions = backend.build_metadata(step.decodes, step.prefills, block_size, window, DEVICE)
    out = backend.paged_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, meta, scale)
    return out.cpu(), positions


def check_step(step, *, heads: int, kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
               window: int | None = None, dtype=torch.float32, seed: int = 0):
    k_pool, v_pool, q, k, v, scale = step_inputs(step, heads, kv_heads, head_dim, block_size, num_blocks, dtype, seed)

    kernel_k, kernel_v = k_pool.to(DEVICE), v_pool.to(DEVICE)
    got, positions = run(triton_backend, step, q, k, v, kernel_k, kernel_v, block_size, window, scale)
    ref_k, ref_v = k_pool.to(DEVICE), v_pool.to(DEVICE)
    ref, ref_positions = run(torch_backend, step, q, k, v, ref_k, ref_v, block_size, window, scale)

    want_k, want_v = pools_after_write(step, k_pool, v_pool, k, v, block_size)
    assert torch.equal(kernel_k.cpu(), want_k) and torch.equal(kernel_v.cpu(), want_v)
    np.testing.assert_array_equal(positions, ref_positions)

    assert got.dtype == dtype and got.shape == q.shape
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)  # the torch reference
    want = hand_attention(q, want_k, want_v, step, block_size, window, scale)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)    # and float64 by hand


SHAPES = {  # heads, kv_heads, head_dim
    "gqa-32": (8, 2, 32),
    "mha-16": (2, 2, 16),
    "mqa-48": (6, 1, 48),   # head dim padded to 64 inside the kernel; group of 6 (not a power of two)
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode(shape, block_size):
    heads, kv_heads, head_dim = SHAPES[shape]
    rng = np.random.default_rng(1)
    step = make_step(rng, 120, block_size, decode_ctx=[1, 2, 17, 33, 70], prefill_spans=[])
    check_step(step, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, num_blocks=120)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_decode_sliding_window(window):
    rng = np.random.default_rng(2)
    step = make_step(rng, 60, 16, decode_ctx=[3, 8, 41, 100], prefill_spans=[])
    check_step(step, heads=4, kv_heads=2, head_dim=32, block_size=16, num_blocks=60, window=window)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_chunks(shape):
    """Fresh chunks and chunks after cached keys (a prefix hit, a later piece of a chunked
    prefill), one query tile and several, starting mid-block or on a block boundary."""
    heads, kv_heads, head_dim = SHAPES[shape]
    rng = np.random.default_rng(3)
    spans = [(0, 1), (0, 9), (0, 37), (16, 20), (37, 18), (5, 1), (64, 3)]
    step = make_step(rng, 60, 16, decode_ctx=[], prefill_spans=spans)
    check_step(step, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16, num_blocks=60)


@pytest.mark.parametrize("window", [None, 12])
def test_mixed_step(window):
    """Decodes and prefill chunks in one step, as the runner lays them out (decodes first); with
    a window shorter than the chunks, so tiles start their key loop past position 0."""
    rng = np.random.default_rng(4)
    step = make_step(rng, 60, 16, decode_ctx=[5, 48, 129], prefill_spans=[(0, 40), (60, 25)])
    check_step(step, heads=4, kv_heads=2, head_dim=32, block_size=16, num_blocks=60, window=window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(dtype):
    rng = np.random.default_rng(5)
    step = make_step(rng, 40, 16, decode_ctx=[1, 40, 150], prefill_spans=[(0, 20), (32, 17)])
    check_step(step, heads=8, kv_heads=2, head_dim=32, block_size=16, num_blocks=40, dtype=dtype)


def test_stale_ids_past_the_context_are_never_read():
    """Table entries past a sequence's context may hold anything, even ids far outside the pool
    (a table reused from a longer request): they must be neither read nor refused."""
    rng = np.random.default_rng(6)
    step = make_step(rng, 40, 16, decode_ctx=[17, 32], prefill_spans=[(3, 10)])
    step.decodes = [(np.append(b, [10**6, 10**7]), p) for b, p in step.decodes]
    step.prefills = [(np.append(b, [10**6]), s, n) for b, s, n in step.prefills]
    check_step(step, heads=4, kv_heads=2, head_dim=32, block_size=16, num_blocks=40)


def test_large_scores_stay_finite():
    """Scores far apart (peaked softmax, large magnitudes): the online max must keep exp2 in range."""
    rng = np.random.default_rng(7)
    step = make_step(rng, 20, 16, decode_ctx=[90], prefill_spans=[(40, 20)])
    gen = torch.Generator().manual_seed(0)
    k_pool = (torch.randn(320, 2, 32, generator=gen) * 30).to(DEVICE)
    v_pool = torch.randn(320, 2, 32, generator=gen).to(DEVICE)
    q, k, v = kv_views(step.num_tokens, 4, 2, 32, torch.float32, gen)
    got, _ = run(triton_backend, step, q * 30, k, v, k_pool, v_pool, 16, None, 32 ** -0.5)
    want = hand_attention(q * 30, k_pool.cpu(), v_pool.cpu(), step, 16, None, 32 ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_padding_rows_write_and_store_nothing():
    """CUDA-graph batches are padded with slot -1 and sequences of no tokens: the pool and the
    padded output rows keep what they held."""
    gen = torch.Generator().manual_seed(8)
    pool = torch.randn(2, 4 * 16, 2, 32, generator=gen).to(DEVICE)
    before = pool.clone()
    q, k, v = (t.to(DEVICE) for t in kv_views(3, 4, 2, 32, torch.float32, gen))
    table = np.array([[2, 0], [1, 3], [0, 0]], dtype=np.int32)
    meta = triton_backend.upload(np.array([2 * 16 + 4, -1, -1]), 3, np.arange(3, dtype=np.int32),
                                 np.array([1, 0, 0], np.int32), np.array([5, 0, 0], np.int32), table,
                                 np.zeros((0, 2), np.int32), 16, None, DEVICE)
    out = torch.full_like(q, 7.0)
    triton_backend.write_kv(k, v, pool[0], pool[1], meta.slot_mapping)
    triton_backend.attend(q, pool[0], pool[1], meta, 32 ** -0.5, out)
    changed = (pool != before).any(dim=(2, 3))  # [2, slots]
    assert changed[:, 2 * 16 + 4].all() and changed.sum() == 2, "only the one real token's K and V are written"
    assert (out[1:] == 7.0).all(), "a padded sequence stored output"
    step_keys = pool[0].cpu()[torch.tensor([32, 33, 34, 35, 36])]
    scores = torch.einsum("hd,nhd->hn", q[0].cpu(), step_keys.repeat_interleave(2, dim=1)) * 32 ** -0.5
    values = pool[1].cpu()[torch.tensor([32, 33, 34, 35, 36])].repeat_interleave(2, dim=1)
    torch.testing.assert_close(out[0].cpu(), torch.einsum("hn,nhd->hd", scores.softmax(-1), values))


@pytest.mark.parametrize("where", ["slot_mapping", "block table"])
def test_ids_outside_the_pool_are_refused(where):
    """On a GPU a stray id is an illegal address: a slot or block id past the pool must raise, and write nothing."""
    pool = torch.zeros(2, 4 * 16, 2, 32, device=DEVICE)  # blocks 0-3
    q, k, v = kv_views(1, 4, 2, 32, torch.float32, torch.Generator().manual_seed(0))
    if where == "slot_mapping":  # the new token lands in block 5
        decode = (np.array([1, 2, 3, 0, 5]), 70)
    else:  # the new token's slot (block 3) is fine, but an earlier block of the table is not
        decode = (np.array([7, 2, 3]), 40)
    meta, _ = triton_backend.build_metadata([decode], [], 16, None, DEVICE)
    with pytest.raises(ValueError, match=f"{where} holds"):
        triton_backend.paged_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), pool[0], pool[1], meta, 0.125)
    assert not pool.any()


def test_self_check_passes_and_catches_a_wrong_kernel(monkeypatch):
    triton_check.self_check(DEVICE)
    real = triton_backend.attend
    monkeypatch.setattr(triton_backend, "attend", lambda q, kc, vc, meta, scale, out: real(q, kc, vc, meta,
                                                                                          scale * 1.01, out))
    with pytest.raises(triton_check.TritonUnavailable, match="attention differs"):
        triton_check.self_check(DEVICE)


# -- backend choice ---------------------------------------------------------------------------
@pytest.fixture
def fresh_choice(monkeypatch):
    attention.backend_for.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    attention.backend_for.cache_clear()


def hide_triton(monkeypatch):
    """As if triton were not installed: the next import of the backend fails."""
    monkeypatch.delitem(sys.modules, "pagedserve.attention.triton_backend")
    monkeypatch.delattr(attention, "triton_backend")
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError


def test_missing_triton_falls_back_to_torch_with_one_warning(fresh_choice, caplog):
    hide_triton(fresh_choice)  # import triton -> ImportError
    fresh_choice.setenv(attention.BACKEND_ENV, "auto")
    with caplog.at_level(logging.INFO, logger="pagedserve.attention"):
        assert attention.backend_for("cuda") == "torch"
        assert attention.backend_for("cuda") == "torch"
    records = [r for r in caplog.records if r.name == "pagedserve.attention"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "triton is not importable" in records[0].getMessage()


def test_forced_triton_that_cannot_run_is_an_error(fresh_choice):
    hide_triton(fresh_choice)
    fresh_choice.setenv(attention.BACKEND_ENV, "triton")
    with pytest.raises(RuntimeError, match="PAGEDSERVE_ATTENTION_BACKEND=triton, but"):
        attention.backend_for("cuda")


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter's rules: CPU only")
def test_interpreter_rules_on_cpu(fresh_choice):
    """Forced triton on CPU tensors is the interpreter (tests); interpreted kernels never serve CUDA."""
    fresh_choice.setenv(attention.BACKEND_ENV, "triton")
    assert attention.backend_for("cpu") == "triton"
    with pytest.raises(triton_check.TritonUnavailable, match="TRITON_INTERPRET=1 is set"):
        triton_check.check_triton("cuda")


def test_auto_on_cuda_picks_triton_when_it_works(fresh_choice):
    if DEVICE.type != "cuda":
        pytest.skip("needs a CUDA device (runs in benchmarks/gpu_check.sh); on CPU the fallback tests above run")
    fresh_choice.setenv(attention.BACKEND_ENV, "auto")
    assert attention.backend_for("cuda") == "triton"


# -- end to end ---------------------------------------------------------------------------------
def test_engine_with_triton_matches_hf(fresh_choice, tmp_path):
    """Mistral (sliding window shorter than the prompts, GQA) through the engine with the Triton
    kernels forced and a small token budget (chunked prefill: later chunks read their prefix
    from the pool) must equal HF's greedy tokens."""
    from checkpoints import hf_greedy, make_checkpoint
    from pagedserve import LLM, SamplingParams

    fresh_choice.setenv(attention.BACKEND_ENV, "triton")
    calls = []
    real = triton_backend.paged_attention

    def spy(q, k, v, k_cache, v_cache, meta, scale):
        calls.append(meta.num_decodes + meta.num_prefill_tiles)
        return real(q, k, v, k_cache, v_cache, meta, scale)

    fresh_choice.setattr(triton_backend, "paged_attention", spy)
    path = make_checkpoint(tmp_path / "mistral", "mistral", kv_heads=2, sliding_window=24, layers=1)
    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(2, 384, size=n)] for n in (1, 17, 45)]
    max_tokens = [4, 5, 3]
    want = hf_greedy(path, prompts, max_tokens)
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=32, max_num_batched_tokens=32, device=DEVICE.type)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(calls) > 0, "the Triton kernels attended no row"
