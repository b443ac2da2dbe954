"""The decode step's reused outputs (pagedserve/scratch.py) and reused ctypes arguments
(native.ConvertedArgs): a reused tensor is written with the same values a fresh one would get
(F.linear / the torch references), and a converted argument tuple passes the same values."""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from pagedserve import native, scratch
from pagedserve.model.cpu import fused, gemm
from pagedserve.scratch import ScratchOutput


def test_scratch_hands_back_one_tensor_per_shape_and_keeps_only_small_ones():
    s = ScratchOutput()
    a = s.get((4, 8), torch.float32)
    assert a.shape == (4, 8) and a.is_contiguous()
    assert s.get((4, 8), torch.float32) is a
    b = s.get((5, 8), torch.float32)  # another row count: a new tensor, kept in a's place
    assert b is not a and s.get((5, 8), torch.float32) is b
    assert s.get((5, 8), torch.bfloat16) is not b  # the dtype is part of the key
    big = s.get((scratch.MAX_ROWS + 1, 8), torch.float32)  # a prefill's rows: fresh, not kept
    assert s.get((scratch.MAX_ROWS + 1, 8), torch.float32) is not big
    wide = (2, scratch.MAX_BYTES // 4)  # over the byte cap at 2 rows
    assert s.get(wide, torch.float32) is not s.get(wide, torch.float32)


def test_converted_args_pass_the_same_values_and_convert_on_the_second_sighting():
    libc = ctypes.CDLL(None)
    fn = libc.llabs
    fn.argtypes, fn.restype = [ctypes.c_longlong], ctypes.c_longlong
    call = native.ConvertedArgs(fn, limit=2)
    big = -(1 << 40)  # wider than a C int: a wrong conversion would truncate it
    assert call(big) == 1 << 40 and not call.table  # first sighting: passed as it is
    assert call(big) == 1 << 40 and (big,) in call.table  # second: converted and kept
    assert call(big) == 1 << 40
    assert call(-3) == 3 and call(-4) == 4 and call(-5) == 5  # 'seen' bounded at `limit`
    assert len(call.seen) <= 2
    raw = native.ConvertedArgs(fn, raw=1)
    assert raw.call_raw((ctypes.c_longlong(-7),)) == 7  # leading ctypes objects as given


def test_gemm_into_scratch_equals_f_linear():
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(64, 40, generator=gen), torch.randn(64, generator=gen)
    packed = gemm.pack(weight)
    s = ScratchOutput()
    x1, x2 = torch.randn(3, 40, generator=gen), torch.randn(3, 40, generator=gen)
    y1 = gemm.linear(x1, packed, bias, s)
    torch.testing.assert_close(y1, F.linear(x1, weight, bias), rtol=1e-5, atol=1e-5)
    want = gemm.linear(x2, packed, bias)  # a fresh output
    y2 = gemm.linear(x2, packed, bias, s)
    assert y2 is y1 and torch.equal(y2, want)  # the same tensor, rewritten with x2's values


def test_fused_ops_into_scratch_equal_the_reference():
    if fused.fused_ops_for("cpu") != "cpu":
        pytest.skip("the fused kernels did not build here")
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(48, generator=gen)
    s, t = ScratchOutput(), ScratchOutput()
    for _ in range(2):  # the second pass writes into the first pass's tensors
        x, h = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
        assert torch.equal(fused.rms_norm(x, weight, 1e-5, s), fused.rms_norm_reference(x, weight, 1e-5))
        want_norm, want_res = fused.add_rms_norm_reference(h, x.clone(), weight, 1e-5)
        got_norm, got_res = fused.add_rms_norm(h, x.clone(), weight, 1e-5, s)
        assert torch.equal(got_norm, want_norm) and torch.equal(got_res, want_res)
        gu = torch.randn(5, 96, generator=gen)
        fresh = fused.silu_and_mul(gu)  # the kernel's exp may differ from torch's by an ulp (fused.cpp)
        torch.testing.assert_close(fresh, fused.silu_and_mul_reference(gu), rtol=1e-6, atol=1e-7)
        assert torch.equal(fused.silu_and_mul(gu, t), fresh)
    assert s.tensor is not None and t.tensor is not None
