"""The compiled CPU paged-attention kernel (and the torch reference beside it) against attention
computed by hand in float64 from the same pool: decodes, prefill chunks with and without a
cached prefix, GQA / MHA / MQA, sliding windows, block tables with holes and shuffled ids,
contexts that end mid-block, fp32 / bf16 / fp16 caches, the partitioned path for few long
sequences; the KV write; the backend choice and its fallback; and one engine run against HF.

The kernel must build on the machine running the tests (a C++ compiler is a stated install
requirement): a build failure fails these tests instead of skipping them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pagedserve import attention
from pagedserve.attention import cpu as cpu_kernel
from pagedserve.attention import cpu_backend, torch_backend


@dataclass
class Step:
    """One step's inputs: decodes (block ids, position), prefills (block ids, start, length)."""
    decodes: list[tuple[np.ndarray, int]]
    prefills: list[tuple[np.ndarray, int, int]]

    def sequences(self):
        """(first row, rows, context length, block ids) per request, in layout order."""
        row = 0
        for blocks, pos in self.decodes:
            yield row, 1, pos + 1, blocks
            row += 1
        for blocks, start, n in self.prefills:
            yield row, n, start + n, blocks
            row += n

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, _, n in self.prefills)


def make_step(rng: np.random.Generator, num_blocks: int, block_size: int, decode_ctx: list[int],
              prefill_spans: list[tuple[int, int]]) -> Step:
    """Block ids drawn without replacement from a shuffled pool larger than needed (holes,
    no order); every table gets one spare block past its context, which must never be read."""
    free = list(rng.permutation(num_blocks))

    def table(ctx: int) -> np.ndarray:
        n = -(-ctx // block_size) + 1
        assert len(free) >= n, "test pool too small"
        return np.array([free.pop() for _ in range(n)], dtype=np.int64)

    decodes = [(table(c), c - 1) for c in decode_ctx]
    prefills = [(table(start + n), start, n) for start, n in prefill_spans]
    return Step(decodes, prefills)


def hand_attention(q, k_cache, v_cache, step: Step, block_size: int, window: int | None, scale: float):
    """In float64, per request: row j at position pos sees keys [max(0, pos - window + 1), pos]."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for first, rows, ctx, blocks in step.sequences():
        keys = np.arange(ctx)
        slots = torch.from_numpy(blocks[keys // block_size] * block_size + keys % block_size)
        k = k_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [ctx, H, D]
        v = v_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("rhd,nhd->rhn", q[first:first + rows].double(), k) * scale
        pos = torch.arange(ctx - rows, ctx)[:, None]
        key = torch.from_numpy(keys)[None, :]
        visible = (key <= pos) & ((key > pos - window) if window else True)  # [rows, ctx]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[first:first + rows] = torch.einsum("rhn,nhd->rhd", torch.softmax(scores, dim=-1), v)
    return out


def run_backend(backend, step: Step, q, k, v, k_cache, v_cache, block_size, window, scale):
    meta, positions = backend.build_metadata(step.decodes, step.prefills, block_size, window, torch.device("cpu"))
    out = backend.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    return out, positions


def kv_views(num_tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, gen):
    """q, k, v as the model makes them: views into one fused projection output (row strides)."""
    fused = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (q.reshape(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim),
            v.view(num_tokens, kv_heads, head_dim))


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def step_inputs(step: Step, heads: int, kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                dtype, seed: int):
    """(k_pool, v_pool, q, k, v, scale) for one step. Every slot starts as noise, so a read
    outside a request's context shows in the result."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = num_blocks * block_size
    k_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    q, k, v = kv_views(step.num_tokens, heads, kv_heads, head_dim, dtype, gen)
    return k_pool, v_pool, q, k, v, head_dim ** -0.5


def pools_after_write(step: Step, k_pool, v_pool, k, v, block_size: int):
    """The pools as the step's KV write must leave them: exactly the new tokens' slots changed,
    to the new K/V."""
    slots = []
    for first, rows, ctx, blocks in step.sequences():
        pos = np.arange(ctx - rows, ctx)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    slots = torch.from_numpy(np.concatenate(slots))
    want_k, want_v = k_pool.clone(), v_pool.clone()
    want_k[slots], want_v[slots] = k, v
    return want_k, want_v


def check_step(step: Step, *, heads: int, kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
               window: int | None = None, dtype=torch.float32, seed: int = 0):
    k_pool, v_pool, q, k, v, scale = step_inputs(step, heads, kv_heads, head_dim, block_size, num_blocks, dtype, seed)

    kernel_k, kernel_v = k_pool.clone(), v_pool.clone()
    got, positions = run_backend(cpu_backend, step, q, k, v, kernel_k, kernel_v, block_size, window, scale)
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    ref, ref_positions = run_backend(torch_backend, step, q, k, v, ref_k, ref_v, block_size, window, scale)

    want_k, want_v = pools_after_write(step, k_pool, v_pool, k, v, block_size)
    assert torch.equal(kernel_k, want_k) and torch.equal(kernel_v, want_v)
    assert torch.equal(ref_k, want_k) and torch.equal(ref_v, want_v)
    np.testing.assert_array_equal(positions, ref_positions)

    want = hand_attention(q, want_k, want_v, step, block_size, window, scale)
    assert got.dtype == dtype and got.shape == q.shape
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(ref.double(), want, atol=tol, rtol=tol)  # the reference agrees too
    return got, ref


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    cpu_kernel.load_kernel()  # raises KernelUnavailable (failing every test here) if it cannot build


SHAPES = {  # heads, kv_heads, head_dim
    "gqa-64": (8, 2, 64),
    "mha-128": (4, 4, 128),
    "mqa-48": (6, 1, 48),
    "gqa-16": (4, 2, 16),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode(shape, block_size):
    heads, kv_heads, head_dim = SHAPES[shape]
    rng = np.random.default_rng(1)
    step = make_step(rng, 400, block_size, decode_ctx=[1, 2, 17, 33, 100, 64, 250], prefill_spans=[])
    check_step(step, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, num_blocks=400)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_decode_sliding_window(window):
    rng = np.random.default_rng(2)
    step = make_step(rng, 300, 16, decode_ctx=[3, 7, 8, 41, 100, 333], prefill_spans=[])
    check_step(step, heads=8, kv_heads=2, head_dim=64, block_size=16, num_blocks=300, window=window)


@pytest.fixture(params=["routed", "kernel-only", "tiled-fresh", "tiled-all"])
def routing(request, monkeypatch):
    """As cpu_backend routes chunks (short ones to the kernel's plan, long fresh ones to its tiled
    causal path, long ones after cached keys to its tiled path over the pool, windowed ones to
    SDPA), every chunk through the plan, so its many-row tiles are checked whatever the
    thresholds, every fresh chunk (1 token up) through the tiled path, or every unwindowed chunk,
    fresh or after cached keys, through the tiled paths."""
    if request.param == "kernel-only":
        monkeypatch.setattr(cpu_backend, "KERNEL_MAX_FRESH_CHUNK", 1 << 30)
        monkeypatch.setattr(cpu_backend, "KERNEL_MAX_CACHED_CHUNK", 1 << 30)
    if request.param in ("tiled-fresh", "tiled-all"):
        monkeypatch.setattr(cpu_backend, "KERNEL_MAX_FRESH_CHUNK", 0)
    if request.param == "tiled-all":
        monkeypatch.setattr(cpu_backend, "KERNEL_MAX_CACHED_CHUNK", 0)
    return request.param


@pytest.mark.parametrize("shape", ["gqa-64", "mha-128", "mqa-48"])
def test_prefill_chunks(shape, routing):
    """Fresh chunks and chunks after cached keys (a prefix hit, a later piece of a chunked
    prefill), short and long, starting mid-block or on a block boundary."""
    heads, kv_heads, head_dim = SHAPES[shape]
    rng = np.random.default_rng(3)
    spans = [(0, 1), (0, 9), (0, 150), (16, 20), (37, 90), (5, 1), (30, 8), (64, 3), (200, 70)]
    step = make_step(rng, 200, 16, decode_ctx=[], prefill_spans=spans)
    check_step(step, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16, num_blocks=200)


@pytest.mark.parametrize("window", [None, 24])
def test_mixed_step(window, routing):
    """Decodes and prefill chunks in one step, as the runner lays them out (decodes first)."""
    rng = np.random.default_rng(4)
    step = make_step(rng, 300, 16, decode_ctx=[5, 48, 129], prefill_spans=[(0, 100), (0, 30), (60, 45)])
    check_step(step, heads=4, kv_heads=2, head_dim=64, block_size=16, num_blocks=300, window=window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(dtype, routing):
    if not cpu_kernel.load_kernel().ps_dtype_supported(cpu_kernel.DTYPE_CODES[str(dtype)[6:]]):
        pytest.fail(f"this compiler builds the kernel without {dtype} support")
    rng = np.random.default_rng(5)
    step = make_step(rng, 300, 16, decode_ctx=[1, 40, 300], prefill_spans=[(0, 80), (32, 17)])
    check_step(step, heads=8, kv_heads=2, head_dim=64, block_size=16, num_blocks=300, window=None, dtype=dtype)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_long_contexts_split_across_threads(threads):
    """One or two long decodes: with several threads their keys are split into partitions whose
    partial softmax results are merged; a window makes some partitions start mid-context."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = np.random.default_rng(6)
        step = make_step(rng, 400, 16, decode_ctx=[2048, 1500], prefill_spans=[])
        check_step(step, heads=4, kv_heads=1, head_dim=64, block_size=16, num_blocks=400)
        step = make_step(rng, 400, 16, decode_ctx=[3000], prefill_spans=[(700, 3)])
        check_step(step, heads=4, kv_heads=2, head_dim=64, block_size=16, num_blocks=400, window=1000)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads, kv_heads, window, dtype", [(2, 4, None, torch.float32), (3, 2, 70, torch.bfloat16)])
def test_many_sequences_on_threads_take_all_kv_heads_per_item(threads, kv_heads, window, dtype):
    """Enough sequences for the threads: each item covers all kv heads of its rows and each thread
    claims its next item before finishing the current one (to prefetch its first blocks); uneven
    contexts, prefill chunks and a window, so items differ in length and kv-head blocks in reach."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = np.random.default_rng(8)
        step = make_step(rng, 400, 16, decode_ctx=[int(c) for c in rng.integers(1, 300, size=13)],
                         prefill_spans=[(0, 20), (100, 5)])
        check_step(step, heads=8, kv_heads=kv_heads, head_dim=64, block_size=16, num_blocks=400, window=window,
                   dtype=dtype)
    finally:
        torch.set_num_threads(before)


FRESH_LENGTHS = [1, 7, 16, 17, 33, 100, 257, 600]  # tiles are 32 / group tokens x 16 keys


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("group", [1, 2, 4, 6])
def test_fresh_chunks_tiled(group, head_dim, dtype, threads, monkeypatch):
    """Fresh chunks through the tiled causal path (ps_fresh_prefill): lengths off the tile sizes,
    1 to 600 tokens, beside decodes, a chunk after cached keys and one under a window, GQA groups
    whose tiles have dead lanes (6: 30 of 32), a head_dim that is not a power of two."""
    monkeypatch.setattr(cpu_backend, "KERNEL_MAX_FRESH_CHUNK", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = np.random.default_rng(group * 1000 + head_dim)
        spans = [(0, n) for n in FRESH_LENGTHS] + [(40, 30)]
        step = make_step(rng, 200, 16, decode_ctx=[5, 130], prefill_spans=spans)
        meta, _ = cpu_backend.build_metadata(step.decodes, step.prefills, 16, None, torch.device("cpu"))
        assert [c.q_len for c in meta.fresh_chunks] == FRESH_LENGTHS
        check_step(step, heads=2 * group, kv_heads=2, head_dim=head_dim, block_size=16, num_blocks=200, dtype=dtype)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("group", [32, 33])
def test_fresh_chunks_widest_groups(group):
    """32 query heads per kv head fill a tile with one token; 33 go to SDPA instead."""
    rng = np.random.default_rng(9)
    step = make_step(rng, 100, 16, decode_ctx=[3], prefill_spans=[(0, 70), (0, 20)])
    check_step(step, heads=group, kv_heads=1, head_dim=64, block_size=16, num_blocks=100)


# (start, q_len) of chunks after cached keys: starts on and off block boundaries (16), lengths
# off the tile sizes (32 / group tokens x 16 keys), a start in the same key tile as the chunk's
# first rows, long contexts before short chunks and the reverse.
CACHED_SPANS = [(1, 33), (5, 9), (16, 20), (37, 90), (64, 3), (130, 64), (300, 17), (250, 250), (15, 1), (700, 40)]


def check_against_reference_chunks(got, step: Step, dtype, heads, kv_heads, head_dim, block_size, num_blocks, seed):
    """Each chunk after cached keys beside torch_backend.attend_prefill_chunk over the same pools."""
    k_pool, v_pool, q, k, v, scale = step_inputs(step, heads, kv_heads, head_dim, block_size, num_blocks, dtype, seed)
    k_pool, v_pool = pools_after_write(step, k_pool, v_pool, k, v, block_size)
    tol = TOL[dtype]
    for first, rows, ctx, blocks in step.sequences():
        start = ctx - rows
        if start == 0 or rows == 1 and first < len(step.decodes):
            continue
        c = torch_backend.prefill_chunk(blocks, start, rows, first, block_size, None, torch.device("cpu"))
        want = torch_backend.attend_prefill_chunk(q, k, v, k_pool, v_pool, c, block_size, scale)
        torch.testing.assert_close(got[first:first + rows].double(), want.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_cached_chunks_tiled(group, head_dim, dtype, threads, monkeypatch):
    """Chunks after cached keys through the tiled path over the pool (ps_cached_prefill), every
    one of them (1 token up), in one call beside decodes, fresh chunks (tiled and plan) and a
    windowed chunk; tables are shuffled, non-contiguous blocks with a spare block past the context
    (noise: a read past the context shows)."""
    monkeypatch.setattr(cpu_backend, "KERNEL_MAX_CACHED_CHUNK", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = np.random.default_rng(group * 100 + head_dim)
        spans = CACHED_SPANS + [(0, 40), (0, 5)]
        step = make_step(rng, 400, 16, decode_ctx=[5, 130], prefill_spans=spans)
        meta, _ = cpu_backend.build_metadata(step.decodes, step.prefills, 16, None, torch.device("cpu"))
        assert [(s, n) for _, s, n, _ in meta.cached_spans] == CACHED_SPANS
        assert [c.q_len for c in meta.fresh_chunks] == [40] and not meta.sdpa_chunks
        kw = dict(heads=2 * group, kv_heads=2, head_dim=head_dim, block_size=16, num_blocks=400, dtype=dtype)
        got, _ = check_step(step, **kw, seed=group)
        check_against_reference_chunks(got, step, seed=group, **kw)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("block_size", [5, 7, 32])
def test_cached_chunks_tiled_odd_block_sizes(block_size):
    """Block sizes that are not the key tile's: block boundaries fall inside key tiles."""
    rng = np.random.default_rng(block_size)
    step = make_step(rng, 900, block_size, decode_ctx=[9], prefill_spans=[(3, 50), (21, 100), (200, 9), (0, 30)])
    meta, _ = cpu_backend.build_metadata(step.decodes, step.prefills, block_size, None, torch.device("cpu"))
    assert [(s, n) for _, s, n, _ in meta.cached_spans] == [(3, 50), (21, 100), (200, 9)]
    kw = dict(heads=8, kv_heads=2, head_dim=64, block_size=block_size, num_blocks=900, dtype=torch.float32)
    got, _ = check_step(step, **kw)
    check_against_reference_chunks(got, step, seed=0, **kw)


@pytest.mark.parametrize("window", [None, 100, 300])
def test_cached_chunks_routing(window):
    """Longer chunks after cached keys go to the tiled path unless a window hides some key from
    them (then SDPA); short ones to the plan."""
    rng = np.random.default_rng(11)
    n = cpu_backend.KERNEL_MAX_CACHED_CHUNK
    spans = [(40, n), (40, n + 1), (150, 120)]
    step = make_step(rng, 200, 16, decode_ctx=[], prefill_spans=spans)
    meta, _ = cpu_backend.build_metadata(step.decodes, step.prefills, 16, window, torch.device("cpu"))
    tiled = [(s, q) for _, s, q, _ in meta.cached_spans]
    assert tiled == {None: [(40, n + 1), (150, 120)], 100: [(40, n + 1)], 300: [(40, n + 1), (150, 120)]}[window]
    assert len(meta.sdpa_chunks) == 2 - len(tiled)
    check_step(step, heads=4, kv_heads=1, head_dim=64, block_size=16, num_blocks=200, window=window)


@pytest.mark.parametrize("group", [32, 33])
def test_cached_chunks_widest_groups(group, monkeypatch):
    """32 query heads per kv head through the tiled path after cached keys; 33 go to SDPA."""
    monkeypatch.setattr(cpu_backend, "KERNEL_MAX_CACHED_CHUNK", 0)
    rng = np.random.default_rng(12)
    step = make_step(rng, 100, 16, decode_ctx=[3], prefill_spans=[(30, 70), (17, 20)])
    check_step(step, heads=group, kv_heads=1, head_dim=64, block_size=16, num_blocks=100)


@pytest.mark.parametrize("start", [0, 70])
def test_tiled_chunk_large_scores_stay_finite(start):
    """Peaked scores of large magnitude in the tiled path, fresh (start 0) and after cached keys:
    its lane-wise running max keeps exp in range."""
    rng = np.random.default_rng(10 if start == 0 else 13)
    step = make_step(rng, 100, 16, decode_ctx=[], prefill_spans=[(start, 90)])
    gen = torch.Generator().manual_seed(0)
    k_pool = torch.randn(1600, 2, 64, generator=gen) * 30
    v_pool = torch.randn(1600, 2, 64, generator=gen)
    q, k, v = kv_views(90, 4, 2, 64, torch.float32, gen)
    q, k = q * 30, k * 30
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    got, _ = run_backend(cpu_backend, step, q, k, v, k_pool, v_pool, 16, None, 0.125)
    ref, _ = run_backend(torch_backend, step, q, k, v, ref_k, ref_v, 16, None, 0.125)
    want = hand_attention(q, k_pool, v_pool, step, 16, None, 0.125)
    assert torch.isfinite(got).all()
    # After cached keys, scores of ~1e3 carry fp32 rounding of ~1e-4 into the softmax (SDPA's error
    # is the same); a fresh chunk's stay within 1e-5.
    tol = 1e-5 if start == 0 else 1e-3
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


def test_large_scores_stay_finite():
    """Scores far apart (peaked softmax, large magnitudes): the online max must keep exp in range."""
    rng = np.random.default_rng(7)
    step = make_step(rng, 100, 16, decode_ctx=[90], prefill_spans=[])
    gen = torch.Generator().manual_seed(0)
    k_pool = torch.randn(1600, 2, 64, generator=gen) * 30
    v_pool = torch.randn(1600, 2, 64, generator=gen)
    q, k, v = kv_views(1, 4, 2, 64, torch.float32, gen)
    q = q * 30
    got, _ = run_backend(cpu_backend, step, q, k, v, k_pool, v_pool, 16, None, 0.125)
    want = hand_attention(q, k_pool, v_pool, step, 16, None, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# -- backend choice ---------------------------------------------------------------------------
@pytest.fixture
def fresh_choice(monkeypatch):
    """Forget the process's backend choice and loaded kernel; restore them afterwards."""
    attention.backend_for.cache_clear()
    cpu_kernel.load_kernel.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    attention.backend_for.cache_clear()
    cpu_kernel.load_kernel.cache_clear()


def test_auto_picks_the_kernel_on_cpu(fresh_choice):
    fresh_choice.setenv(attention.BACKEND_ENV, "auto")
    assert attention.backend_for("cpu") == "cpu"
    meta, _ = attention.build_metadata([(np.array([3]), 0)], [], 16, None, torch.device("cpu"))
    assert isinstance(meta, cpu_backend.KernelMetadata)


def test_env_forces_torch(fresh_choice):
    fresh_choice.setenv(attention.BACKEND_ENV, "torch")
    meta, _ = attention.build_metadata([(np.array([3]), 0)], [], 16, None, torch.device("cpu"))
    assert isinstance(meta, torch_backend.AttentionMetadata)


def test_bad_env_value_names_the_variable(fresh_choice):
    fresh_choice.setenv(attention.BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="PAGEDSERVE_ATTENTION_BACKEND='fast'"):
        attention.backend_for("cpu")


def test_no_compiler_falls_back_with_one_warning(fresh_choice, tmp_path, caplog):
    fresh_choice.delenv("CXX", raising=False)
    fresh_choice.setenv("PATH", str(tmp_path / "empty"))  # no c++, g++ or clang++ to find
    fresh_choice.setenv(attention.BACKEND_ENV, "auto")
    with caplog.at_level(logging.INFO, logger="pagedserve.attention"):
        assert attention.backend_for("cpu") == "torch"
        attention.build_metadata([(np.array([0]), 0)], [], 16, None, torch.device("cpu"))
    records = [r for r in caplog.records if r.name == "pagedserve.attention"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "no C++ compiler" in records[0].getMessage()


def test_forced_kernel_that_cannot_build_is_an_error(fresh_choice, tmp_path):
    broken = tmp_path / "paged_attention.cpp"
    broken.write_text("this is not C++\n")
    fresh_choice.setattr(cpu_kernel, "SOURCE", broken)
    fresh_choice.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    fresh_choice.setenv(attention.BACKEND_ENV, "cpu")
    with pytest.raises(RuntimeError, match="failed to compile paged_attention.cpp"):
        attention.backend_for("cpu")


def test_build_is_cached_by_source(fresh_choice, tmp_path):
    """A second process (simulated by forgetting the loaded library) reuses the built file;
    an edited source gets a new file name instead of loading a stale build."""
    built = cpu_kernel.library_path(cpu_kernel.find_compiler())
    cpu_kernel.load_kernel()
    stamp = built.stat().st_mtime_ns
    cpu_kernel.load_kernel.cache_clear()
    cpu_kernel.load_kernel()
    assert built.stat().st_mtime_ns == stamp
    edited = tmp_path / "paged_attention.cpp"
    edited.write_text(cpu_kernel.SOURCE.read_text() + "\n// edited\n")
    fresh_choice.setattr(cpu_kernel, "SOURCE", edited)
    assert cpu_kernel.library_path(cpu_kernel.find_compiler()) != built


# -- end to end ---------------------------------------------------------------------------------
def test_engine_with_kernel_matches_hf(fresh_choice, tmp_path):
    """Mistral (sliding window shorter than the prompts, GQA) through the engine with the kernel
    forced and a small token budget (chunked prefill: later chunks read their prefix from the
    pool) must equal HF's greedy tokens."""
    from checkpoints import greedy_outputs, hf_greedy, make_checkpoint
    from pagedserve import LLM

    fresh_choice.setenv(attention.BACKEND_ENV, "cpu")
    kernel_rows = []
    real = cpu_backend.paged_attention

    def spy(q, k, v, k_cache, v_cache, meta, scale, scratch=None):
        kernel_rows.append(meta.plan.num_seqs)
        return real(q, k, v, k_cache, v_cache, meta, scale, scratch)

    fresh_choice.setattr(cpu_backend, "paged_attention", spy)
    path = make_checkpoint(tmp_path / "mistral", "mistral", kv_heads=2, sliding_window=24)
    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(2, 384, size=n)] for n in (1, 17, 60, 100)]
    max_tokens = [8, 12, 6, 10]
    want = hf_greedy(path, prompts, max_tokens)
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=48)
    assert greedy_outputs(llm, prompts, max_tokens) == want  # (and every block came back)
    assert sum(kernel_rows) > 0, "the kernel attended no row"


@pytest.mark.parametrize("where", ["slot_mapping", "block table", "cached chunk's block table"])
def test_ids_outside_the_pool_are_refused(where):
    """The kernel touches raw memory: a slot or block id past the pool must raise, and write nothing."""
    pool = torch.zeros(2, 4 * 16, 2, 64)  # blocks 0-3
    tokens = 12 if where.startswith("cached") else 1
    q, k, v = kv_views(tokens, 4, 2, 64, torch.float32, torch.Generator().manual_seed(0))
    decodes, prefills = [], []
    if where == "slot_mapping":  # the new token lands in block 5
        decodes = [(np.array([1, 2, 3, 0, 5]), 70)]
    elif where == "block table":  # the new token's slot (block 3) is fine, but an earlier block of the table is not
        decodes = [(np.array([7, 2, 3]), 40)]
    else:  # a chunk for the tiled path over the pool: its new tokens' slots (block 2) are fine, block 7 is not
        prefills = [(np.array([7, 2]), 20, 12)]
        where = "block table"
    meta, _ = cpu_backend.build_metadata(decodes, prefills, 16, None, torch.device("cpu"))
    assert bool(meta.cached_spans) == bool(prefills)
    with pytest.raises(ValueError, match=f"{where} holds"):
        cpu_backend.paged_attention(q, k, v, pool[0], pool[1], meta, 0.125)
    assert not pool.any()
