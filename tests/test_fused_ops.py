"""The fused elementwise kernels (model/cpu/fused.cpp) against the torch expressions they replace,
written out here as HF's Llama writes them: RMSNorm, residual add + RMSNorm, SiLU(gate) * up and
RoPE, in fp32 and bf16, on odd widths, one row and many, and row-strided views; the choice of
path (PAGEDSERVE_FUSED_OPS) and its fallback; and the engine with the kernels against HF.

Exactness: all four equal torch bit for bit in both dtypes (the kernel repeats each op's rounding,
torch's summation order for the mean of squares, and for SiLU the exp torch used for each element
of HF's contiguous gate: SLEEF's vectorised expf, found in libtorch_cpu at load, in torch's vector
lanes, std::exp in its scalar tails). Under ATEN_CPU_CAPABILITY=default torch's SiLU uses
std::exp throughout, as the kernel then does (test_exact_against_scalar_torch).

The kernels must build on the machine running the tests: a build failure fails these tests.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedserve.model.cpu import fused

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


# -- the references, as HF's modeling_llama writes them -----------------------------------------
def hf_rms_norm(x, weight, eps):
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(x.dtype)


def hf_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(x, cos, sin):
    return (x * cos) + (hf_rotate_half(x) * sin)


def hf_silu_mul(gate, up):
    return F.silu(gate) * up


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    """Every test starts with the kernels chosen (auto, built) and leaves the choice forgotten."""
    fused.fused_ops_for.cache_clear()
    monkeypatch.setenv(fused.FUSED_ENV, "auto")
    assert fused.fused_ops_for("cpu") == "cpu", "the fused kernels did not build"
    yield monkeypatch
    monkeypatch.undo()
    fused.fused_ops_for.cache_clear()
    fused.load_library.cache_clear()


def strided_rows(rows: int, cols: int, dtype, gen, pad: int = 7) -> torch.Tensor:
    """[rows, cols] whose rows start cols + pad elements apart (a slice of a wider tensor)."""
    return torch.randn(rows, cols + pad, generator=gen).to(dtype)[:, :cols]


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-signed fp32 values."""
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


# -- each kernel against its reference ----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 255), (37, 255), (37, 64), (5, 3), (3, 1000)])
def test_rms_norm(dtype, rows, cols):
    gen = torch.Generator().manual_seed(rows * cols)
    x = strided_rows(rows, cols, dtype, gen) * 3
    weight = torch.randn(cols, generator=gen).to(dtype)
    got = fused.rms_norm(x, weight, EPS)
    assert got.dtype == dtype and got.shape == (rows, cols)
    assert torch.equal(got, hf_rms_norm(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 255), (37, 255), (4, 1000)])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, rows, cols):
    gen = torch.Generator().manual_seed(cols + rows)
    x = strided_rows(rows, cols, dtype, gen)
    residual = strided_rows(rows, cols, dtype, gen, pad=3)
    weight = torch.randn(cols, generator=gen).to(dtype)
    want_sum = residual + x  # the unfused `h = h + attn(...)` in the activation dtype
    want = hf_rms_norm(want_sum, weight, EPS)
    before = residual.clone()
    out, new_residual = fused.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(new_residual, want_sum)
    assert torch.equal(out, want)
    assert new_residual.data_ptr() == residual.data_ptr() and not torch.equal(residual, before)  # in place


def silu_scalar(gate: torch.Tensor) -> torch.Tensor:
    """torch's F.silu through its scalar loop (std::exp) for every element: pieces of 8 elements
    are shorter than one vector block (2 x Vectorized: 16 floats under AVX2, 32 under AVX-512;
    pieces of 16 were a whole block under AVX2 and went through its vector exp)."""
    return torch.cat([F.silu(piece) for piece in gate.flatten().split(8)]).view_as(gate)


def silu_vector(gate: torch.Tensor) -> torch.Tensor:
    """torch's F.silu through its vector loop for every element (one thread, padded to whole
    blocks of 64 elements)."""
    flat = gate.flatten()
    padded = torch.cat([flat, flat.new_zeros(-flat.numel() % 64)])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return F.silu(padded)[:flat.numel()].view_as(gate)
    finally:
        torch.set_num_threads(before)


def silu_telling_values(n: int, gen) -> torch.Tensor:
    """n fp32 gate values (from 4 * N(0, 1)) whose F.silu differs between torch's vector exp
    (SLEEF, ~4% of such values here) and its scalar std::exp: a gate made of them shows, element
    by element, which exp a kernel used. Plain 4 * N(0, 1) values where the two never differ
    (torch's DEFAULT capability; and under AVX2 here SLEEF's expf8 agreed with glibc's expf on
    every value tried)."""
    pool = torch.randn(1 << 15, generator=gen) * 4
    telling = pool[silu_scalar(pool) != silu_vector(pool)]
    if telling.numel() == 0:
        return torch.randn(n, generator=gen) * 4
    return telling[torch.randint(telling.numel(), (n,), generator=gen)]


# (rows, inter): single rows, a row shorter than a vector block, odd widths whose flat tensor
# leaves a scalar tail, 19M's and 246M's widths, and tensors over torch's grain size (32768
# elements), which two threads split into chunks with a tail each.
SILU_SHAPES = [(1, 343), (37, 343), (8, 64), (3, 20), (1, 5), (33, 688), (4, 2816), (101, 343), (3, 12289)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", SILU_SHAPES)
def test_silu_and_mul(dtype, rows, inter, threads):
    """Bit for bit HF's F.silu(gate_proj(x)) * up_proj(x), on the contiguous gate and up HF has
    (torch's vector exp where torch's vector loop ran, its std::exp in the scalar tails), from
    the kernel's row-strided view of the fused gate_up. fp32 gates are made of values whose
    SiLU tells the two exps apart. (bf16: no bf16 input's SiLU differs between them, by
    test_silu_bf16_is_exp_independent, so bf16 checks the widening and the two roundings.)"""
    gen = torch.Generator().manual_seed(inter + rows)
    x = strided_rows(rows, 2 * inter, torch.float32, gen, pad=5) * 4
    x[:, :inter] = silu_telling_values(rows * inter, gen).view(rows, inter)
    x = x.to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        want = hf_silu_mul(x[:, :inter].contiguous(), x[:, inter:].contiguous())
        got = fused.silu_and_mul(x)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (rows, inter) and got.dtype == dtype
    differ = f"{int((got != want).sum())} of {got.numel()} differ, {ulps(got.float(), want.float())} ulps"
    assert torch.equal(got, want), differ


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_special_values(dtype):
    """Infinities, NaN, signed zeros, denormals and exp's overflow and underflow give torch's
    bits (NaN where torch has NaN), in vector lanes and in the scalar tail."""
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, -100.0, 100.0, 88.7, -88.7,
                            -87.0, 1e-40, -1e-40, 3e38, -3e38, -104.0, -10.0, -20.0])
    gate = special.repeat(9)[:150].view(1, 150).to(dtype)
    up = torch.full_like(gate, 1.5)
    want, got = hf_silu_mul(gate, up), fused.silu_and_mul(torch.cat([gate, up], dim=1))
    assert torch.equal(got.isnan(), want.isnan())
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    kept = ~want.isnan()
    assert torch.equal(got[kept].view(bits), want[kept].view(bits))


def test_silu_tails_are_torchs_scalar_ones():
    """The exactness above depends on both exps: on a telling gate, torch's own F.silu (two
    threads, chunks over the grain size) equals neither the all-vector nor the all-scalar
    evaluation, and the kernel equals it."""
    rows, inter = 101, 343
    gen = torch.Generator().manual_seed(7)
    gate = silu_telling_values(rows * inter, gen).view(rows, inter)
    if torch.equal(silu_scalar(gate), silu_vector(gate)):
        pytest.skip("torch's vector and scalar SiLU agree here (DEFAULT capability, or AVX2)")
    up = torch.randn(rows, inter, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = F.silu(gate)
        got = fused.silu_and_mul(torch.cat([gate, torch.ones_like(up)], dim=1))
    finally:
        torch.set_num_threads(before)
    assert not torch.equal(want, silu_vector(gate)) and not torch.equal(want, silu_scalar(gate))
    assert torch.equal(got, want)


def test_silu_bf16_is_exp_independent():
    """Every finite bf16 gate value gets the same bf16 SiLU from torch's vector and scalar exp,
    so the bf16 kernel's exactness does not rest on which exp it uses."""
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[torch.isfinite(values)]
    assert torch.equal(silu_scalar(values), silu_vector(values))


def test_missing_vector_exp_keeps_std_exp_and_says_why(kernels_on, caplog):
    """Where torch's SLEEF expf cannot be found (another torch build), SiLU keeps std::exp for
    every element, and one log line names the symbol."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in fused.VECTOR_EXP_SYMBOLS:
        pytest.skip(f"torch's capability {capability} uses no vector exp")
    kernels_on.setitem(fused.VECTOR_EXP_SYMBOLS, capability, ("Sleef_no_such_expf", 16))
    gen = torch.Generator().manual_seed(9)
    gate, up = silu_telling_values(3 * 100, gen).view(3, 100), torch.randn(3, 100, generator=gen)
    try:
        fused.torch_vector_exp.cache_clear()
        fused.load_library.cache_clear()
        fused.fused_ops_for.cache_clear()
        with caplog.at_level(logging.INFO, logger="pagedserve.model.fused"):
            for _ in range(3):
                got = fused.silu_and_mul(torch.cat([gate, up], dim=1))
    finally:
        fused.torch_vector_exp.cache_clear()
        fused.load_library.cache_clear()
    records = [r for r in caplog.records if r.name == "pagedserve.model.fused"]
    assert len(records) == 1 and "Sleef_no_such_expf" in records[0].getMessage()
    assert torch.equal(got, silu_scalar(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 37])
def test_rotary_in_place_on_split_views(dtype, rows):
    """q and k as the model has them: views of one fused qkv row (row stride q + 2 kv)."""
    heads, kv_heads, head_dim = 6, 2, 50
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)
    want_q, want_k, v_before = hf_rope(q, cos, sin), hf_rope(k, cos, sin), v.clone()
    got_q, got_k = fused.apply_rotary(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # the kernel served, in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(v, v_before)


def test_exact_against_scalar_torch():
    """With torch's scalar kernels (std::exp in SiLU), every fused op equals torch exactly in
    fp32 and bf16: the rounding order is the same, op for op."""
    script = Path(__file__).with_name("fused_exact_probe.py")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "exact", done.stdout


def test_threads_split_rows_the_same():
    """Many rows across threads give what one thread gives (rows are independent)."""
    gen = torch.Generator().manual_seed(3)
    x = strided_rows(200, 513, torch.float32, gen)
    weight = torch.randn(513, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused.rms_norm(x, weight, EPS)
        torch.set_num_threads(2)
        two = fused.rms_norm(x, weight, EPS)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two) and torch.equal(one, hf_rms_norm(x, weight, EPS))


def test_unsupported_tensors_take_the_reference():
    """fp16, mixed dtypes and a non-contiguous last dim are computed by the torch expressions."""
    gen = torch.Generator().manual_seed(4)
    x16 = torch.randn(3, 40, generator=gen).half()
    assert torch.equal(fused.rms_norm(x16, torch.ones(40).half(), EPS), hf_rms_norm(x16, torch.ones(40).half(), EPS))
    mixed_w = torch.randn(40, generator=gen)
    xb = torch.randn(3, 40, generator=gen).bfloat16()
    assert torch.equal(fused.rms_norm(xb, mixed_w, EPS), hf_rms_norm(xb, mixed_w, EPS))
    cols = torch.randn(40, 3, generator=gen).t()  # [3, 40] with last-dim stride 3
    assert torch.equal(fused.silu_and_mul(cols), hf_silu_mul(cols[:, :20], cols[:, 20:]))
    assert torch.equal(fused.rms_norm(cols, torch.ones(40), EPS), hf_rms_norm(cols, torch.ones(40), EPS))


# -- the choice of path -------------------------------------------------------------------------
def test_env_forces_torch(kernels_on):
    fused.fused_ops_for.cache_clear()
    kernels_on.setenv(fused.FUSED_ENV, "torch")
    assert fused.fused_ops_for("cpu") == "torch"
    x = torch.randn(2, 8, 64)
    cos, sin = torch.ones(2, 1, 64), torch.zeros(2, 1, 64)
    q, _ = fused.apply_rotary(x, x[:, :2], cos, sin)
    assert q.data_ptr() != x.data_ptr()  # the reference made new tensors


def test_bad_env_value_names_the_variable(kernels_on):
    fused.fused_ops_for.cache_clear()
    kernels_on.setenv(fused.FUSED_ENV, "fast")
    with pytest.raises(ValueError, match="PAGEDSERVE_FUSED_OPS='fast'"):
        fused.fused_ops_for("cpu")


def test_no_compiler_falls_back_with_one_warning(kernels_on, tmp_path, caplog):
    fused.fused_ops_for.cache_clear()
    fused.load_library.cache_clear()
    kernels_on.delenv("CXX", raising=False)
    kernels_on.setenv("PATH", str(tmp_path / "empty"))  # no c++, g++ or clang++ to find
    kernels_on.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))  # and no cached build
    x, weight = torch.randn(3, 40), torch.randn(40)
    with caplog.at_level(logging.INFO, logger="pagedserve.model.fused"):
        for _ in range(3):
            assert torch.equal(fused.rms_norm(x, weight, EPS), hf_rms_norm(x, weight, EPS))
    records = [r for r in caplog.records if r.name == "pagedserve.model.fused"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "no C++ compiler" in records[0].getMessage()
    assert fused.fused_ops_for("cpu") == "torch"


def test_forced_kernels_that_cannot_build_are_an_error(kernels_on, tmp_path):
    fused.fused_ops_for.cache_clear()
    fused.load_library.cache_clear()
    kernels_on.delenv("CXX", raising=False)
    kernels_on.setenv("PATH", str(tmp_path / "empty"))
    kernels_on.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    kernels_on.setenv(fused.FUSED_ENV, "cpu")
    with pytest.raises(RuntimeError, match="PAGEDSERVE_FUSED_OPS=cpu"):
        fused.fused_ops_for("cpu")


# -- end to end -----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,extra", [("llama", {}), ("qwen2", {})])
def test_engine_with_fused_ops_matches_hf(kernels_on, tmp_path, arch, extra):
    """The engine with the kernels forced (odd hidden width, GQA, chunked prefill, decode steps
    of one and of several rows) must give HF's greedy tokens, and the kernels must have run."""
    from checkpoints import hf_greedy, make_checkpoint
    from pagedserve import LLM, SamplingParams

    fused.fused_ops_for.cache_clear()
    kernels_on.setenv(fused.FUSED_ENV, "cpu")
    calls = {"norm": 0, "add": 0, "silu": 0, "rope": 0}
    lib = fused.load_library()

    class Counting:
        def __getattr__(self, name):
            fn = getattr(lib, name)
            key = {"ps_rms_norm": "norm", "ps_add_rms_norm": "add", "ps_silu_and_mul": "silu", "ps_rotary": "rope"}

            def counted(*args):
                calls[key[name]] += 1
                return fn(*args)
            return counted if name in key else fn

    kernels_on.setattr(fused, "load_library", lambda: Counting())
    path = make_checkpoint(tmp_path / arch, arch, hidden=72, heads=4, kv_heads=2, inter=100, layers=3, **extra)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(2, 384, size=n)] for n in (1, 9, 40)]
    max_tokens = [10, 6, 8]
    want = hf_greedy(path, prompts, max_tokens)
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=32, max_num_batched_tokens=24)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(n > 0 for n in calls.values()), calls
