"""The packed-panel CPU GEMM (pagedserve/model/cpu/gemm.cpp) against F.linear in fp32, for each
of its three code paths: the one this CPU builds (-march=native), and, on x86, the AVX2 and the
portable paths built explicitly, so an AVX-512 machine also checks what an AMD AVX2 CI machine
or an ARM server will run."""
from __future__ import annotations

import ctypes
import platform

import pytest
import torch
import torch.nn.functional as F

from pagedserve import native
from pagedserve.cpu_isa import cpu_features
from pagedserve.model.cpu import gemm

X86 = platform.machine() in ("x86_64", "AMD64")
# name -> flags replacing -march=native; None = the build the engine uses
BUILDS = {"native": None}
if X86:
    if cpu_features().avx2:  # a build this CPU can run
        BUILDS["avx2"] = "-march=haswell"   # AVX2 + FMA, no AVX-512
    BUILDS["portable"] = "-march=x86-64"    # SSE2 only: the plain-loop path


@pytest.fixture(scope="module", params=list(BUILDS))
def lib(request, tmp_path_factory):
    march = BUILDS[request.param]
    if march is None:
        return gemm.load_gemm()
    flags = tuple(march if f == "-march=native" else f for f in native.FLAGS)
    target = tmp_path_factory.mktemp("gemm") / f"gemm-{request.param}.so"
    native.compile_library(native.find_compiler(), gemm.SOURCE, target, flags)
    built = ctypes.CDLL(str(target))
    gemm.bind(built)
    return built


def test_tall_x_in_row_blocks(lib):
    """A prefill-sized x is swept in blocks of rows (~1 MB each: 128 rows at K=2048); 300 rows
    end in a partial block whose last micro-kernel call has a remainder of rows."""
    check(lib, 300, 2048)


def run(lib, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> torch.Tensor:
    nr = lib.ps_gemm_panel_width()
    n, k = weight.shape
    packed = torch.empty(n // nr, k, nr)
    lib.ps_gemm_pack(weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr())
    out = torch.full((x.shape[0], n), float("nan"))
    lib.ps_gemm(x.data_ptr(), x.stride(0), x.shape[0], k, packed.data_ptr(), n,
                bias.data_ptr() if bias is not None else None, out.data_ptr(), n, threads)
    return out


@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 33])
@pytest.mark.parametrize("k", [1, 3, 19, 256])
def test_matches_fp32_linear(lib, m, k):
    """Every row-count remainder of the 8-row (4-row on AVX2) micro-kernel, the one-row kernel's
    k % 4 tail, strided rows of x, with and without bias, one and two threads."""
    check(lib, m, k)


def check(lib, m: int, k: int) -> None:
    nr = lib.ps_gemm_panel_width()
    n = 3 * nr
    gen = torch.Generator().manual_seed(m * 1000 + k)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, 2 * k + 5, generator=gen)[:, :k]  # rows strided as a split() gives them
    for b in (None, bias):
        want = F.linear(x, weight, b)
        for threads in (1, 2):
            got = run(lib, x, weight, b, threads)
            # a different summation order: error bound ~ k * eps * |terms|, terms ~ N(0, 1)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 + 2e-7 * k)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_decode_rows_split_across_threads(lib, m):
    """A decode-sized x (1-4 rows) over a weight of >= 2^16 elements, which the kernel splits
    across the threads whatever M: 7 panels, so two or three threads get runs of different
    lengths. Equal to F.linear, and bit for bit the one-thread result (the summation order
    depends on M and K only, never on the thread count)."""
    nr = lib.ps_gemm_panel_width()
    n = 7 * nr
    k = -(-(1 << 16) // n) + 3
    gen = torch.Generator().manual_seed(m)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    one = run(lib, x, weight, bias, 1)
    for threads in (2, 3):
        assert torch.equal(run(lib, x, weight, bias, threads), one)
    torch.testing.assert_close(one, F.linear(x, weight, bias), rtol=1e-5, atol=1e-6 + 2e-7 * k)


@pytest.mark.parametrize("m,n,k", [(33, 8192, 19), (9, 32000, 5), (1, 262144 + 64, 3)])
def test_large_output_written_streaming(lib, m, n, k):
    """An output of >= 1 MB (the LM head's logits) is written with non-temporal stores where
    the output and its row stride are 64-byte aligned, and with ordinary stores where not (the
    rows here start 1 and 17 floats past an aligned address): every element equal to F.linear
    in each case, one and two threads, with the row remainders of 33 and 9 rows and one row."""
    nr = lib.ps_gemm_panel_width()
    n = n // nr * nr
    gen = torch.Generator().manual_seed(m + n + k)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    packed = torch.empty(n // nr, k, nr)
    lib.ps_gemm_pack(weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr())
    want = F.linear(x, weight, bias)
    for pad, shift in ((0, 0), (0, 1), (17, 0)):
        for threads in (1, 2):
            buf = torch.full((m * (n + pad) + shift,), float("nan"))
            lib.ps_gemm(x.data_ptr(), k, m, k, packed.data_ptr(), n, bias.data_ptr(), buf.data_ptr() + 4 * shift,
                        n + pad, threads)
            got = buf[shift:].view(m, n + pad)[:, :n]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 + 2e-7 * k)


def test_pack_refuses_what_it_cannot_hold():
    nr = gemm.panel_width()
    with pytest.raises(ValueError, match="multiple of"):
        gemm.pack(torch.randn(nr + 1, 8))
    packed = gemm.pack(torch.randn(nr, 8))
    with pytest.raises(ValueError, match="does not fit"):
        gemm.linear(torch.randn(2, 9), packed, None)
    with pytest.raises(ValueError, match="does not fit"):
        gemm.linear(torch.randn(2, 8, dtype=torch.float64), packed, None)


def run_bf16(lib, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> torch.Tensor:
    nr = lib.ps_gemm_bf16_panel_width()
    n, k = weight.shape
    packed = torch.empty(n // nr, k, nr, dtype=torch.bfloat16)
    lib.ps_gemm_bf16_pack(weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr())
    out = torch.full((x.shape[0], n), float("nan"), dtype=torch.bfloat16)
    lib.ps_gemm_bf16(x.data_ptr(), x.stride(0), x.shape[0], k, packed.data_ptr(), n,
                     bias.data_ptr() if bias is not None else None, out.data_ptr(), n, threads)
    return out


@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 25, 28, 29, 33, 300])
@pytest.mark.parametrize("k", [1, 2, 3, 19, 256, 2048])
def test_bf16_matches_fp32_matmul_of_the_same_bf16_values(lib, m, k):
    """The AVX512-BF16 kernel against an fp32 matmul of the same bf16 x, W and bias: fp32
    accumulation, then one rounding to bf16, so |error| <= 2^-8 |exact| (bf16's half ulp,
    with room for a tie) + the fp32 summation bound. Covers every row remainder of the 8-row
    kernel and of the 6-row two-panel one (from 24 rows: 8 single-panel rows, then 6-row
    passes; 25, 28, 29, 33 and 300 leave 5, 2, 3, 1 and 4 or 0; n = 3 panels leaves an odd
    last panel to the 8-row kernel), odd K (the last k
    step stored alone), the one-row kernel's 4-way k-pair split, a tall x swept in row blocks,
    strided rows, bias, one and two threads. Builds without the kernel (AVX2, portable, or a
    CPU without AVX512-BF16) report a panel width of 0."""
    nr = lib.ps_gemm_bf16_panel_width()
    if not nr:
        assert not (cpu_features().avx512_bf16 and lib is gemm.load_gemm())
        return
    n = 3 * nr
    gen = torch.Generator().manual_seed(m * 1000 + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(m, 2 * k + 6, generator=gen).bfloat16()[:, :k]
    for b in (None, bias):
        want = F.linear(x.double(), weight.double(), None if b is None else b.double())
        scale = F.linear(x.double().abs(), weight.double().abs(), None if b is None else b.double().abs())
        for threads in (1, 2):
            got = run_bf16(lib, x, weight, b, threads).double()
            bound = 2.0 ** -8 * want.abs() + 2 * (k + 1) * 2.0 ** -24 * scale + 1e-30
            assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max().item()


def test_bf16_linear_refuses_mixed_dtypes():
    if not gemm.panel_width(torch.bfloat16):
        pytest.skip("no AVX512-BF16 kernel in this build")
    packed = gemm.pack(torch.randn(32, 8).bfloat16())
    assert packed.dtype == torch.bfloat16 and packed.shape == (1, 8, 32)
    with pytest.raises(ValueError, match="does not fit"):
        gemm.linear(torch.randn(2, 8), packed, None)  # fp32 x, bf16 weight
    with pytest.raises(ValueError, match="does not fit"):
        gemm.linear(torch.randn(2, 8).bfloat16(), packed, torch.randn(32))  # fp32 bias
