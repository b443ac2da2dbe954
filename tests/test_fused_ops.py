"""The fused elementwise kernels (model/cpu/fused.cpp) against the torch expressions they replace,
written out here as HF's Llama writes them: RMSNorm, residual add + RMSNorm, SiLU(gate) * up and
RoPE, in fp32 and bf16, on odd widths, one row and many, and row-strided views; the choice of
path (PAGEDSERVE_FUSED_OPS) and its fallback; and the engine with the kernels against HF.

Exactness: RMSNorm, add + RMSNorm and RoPE equal torch bit for bit in both dtypes (the kernel
repeats each op's rounding, and torch's summation order for the mean of squares). SiLU's exp is
glibc's expf in the kernel but SLEEF's vectorised expf in torch's vector kernels, so an fp32
SiLU may differ by a few ulp (and a bf16 one, rarely, by one bf16 ulp); under
ATEN_CPU_CAPABILITY=default torch's SiLU uses std::exp too, and there all four match exactly
(test_exact_against_scalar_torch).

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 343), (37, 343), (8, 64)])
def test_silu_and_mul(dtype, rows, inter):
    gen = torch.Generator().manual_seed(inter + rows)
    x = strided_rows(rows, 2 * inter, dtype, gen, pad=5) * 4  # wide enough for silu's tails
    want = hf_silu_mul(x[:, :inter], x[:, inter:])
    got = fused.silu_and_mul(x)
    assert got.shape == (rows, inter) and got.dtype == dtype
    same = (got == want).float().mean().item()
    if dtype == torch.float32:
        assert ulps(got, want) <= 4 and same > 0.9  # the exp differs (module docstring)
    else:
        assert same > 0.999 and torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=0)


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
