"""ctypes binding of gemm.cpp, the packed-panel GEMM for decode-sized batches on CPU: fp32, and
bf16 (AVX512-BF16 dot products, fp32 accumulation) where the library was built for a CPU with it.

Invariant: a packed weight is a [N / NR, K, NR] tensor of the weight's dtype (NR = the
library's panel width for that dtype, fixed by the ISA it was built for), so N = size(0) *
size(2) and K = size(1); `linear` refuses anything else rather than reading memory it does not
own. A bf16 panel's inner order pairs up k steps (gemm.cpp); only gemm.cpp reads it.
"""
from __future__ import annotations

import ctypes
import sys
from functools import cache
from pathlib import Path

import torch

from pagedserve import native
from pagedserve.scratch import ScratchOutput

SOURCE = Path(__file__).with_name("gemm.cpp")
ABI_VERSION = 2


def bind(lib: ctypes.CDLL) -> None:
    c_int, c_i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.ps_gemm_panel_width.restype = c_int
    lib.ps_gemm_pack.argtypes = [ptr, c_i64, c_i64, c_i64, ptr]
    lib.ps_gemm_pack.restype = None
    lib.ps_gemm.argtypes = [ptr, c_i64, c_i64, c_i64, ptr, c_i64, ptr, ptr, c_i64, c_int]
    lib.ps_gemm.restype = None
    lib.ps_gemm_bf16_panel_width.restype = c_int
    lib.ps_gemm_bf16_pack.argtypes = [ptr, c_i64, c_i64, c_i64, ptr]
    lib.ps_gemm_bf16_pack.restype = None
    lib.ps_gemm_bf16.argtypes = [ptr, c_i64, c_i64, c_i64, ptr, c_i64, ptr, ptr, c_i64, c_int]
    lib.ps_gemm_bf16.restype = None


@cache
def load_gemm() -> ctypes.CDLL:
    """The compiled GEMM library (built now if no cached build fits); NativeUnavailable says why not."""
    return native.load_library(SOURCE, ABI_VERSION, bind, "CPU GEMM kernel")


def panel_width(dtype: torch.dtype = torch.float32) -> int:
    """Output columns per packed panel for `dtype`; 0 for bf16 where the library was built
    without AVX512-BF16 (the CPU it was compiled for, by -march=native, lacks it)."""
    if dtype == torch.bfloat16:
        return load_gemm().ps_gemm_bf16_panel_width()
    return load_gemm().ps_gemm_panel_width() if dtype == torch.float32 else 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 or bf16 weight -> [N / NR, K, NR] panels of the same dtype."""
    n, k = weight.shape
    nr = panel_width(weight.dtype)
    if not nr or n % nr or weight.stride(1) != 1:
        raise ValueError(f"gemm.pack: needs an fp32 (or, with AVX512-BF16, bf16) [N, K] weight with K contiguous "
                         f"and N a multiple of {nr or 'the panel width'}, "
                         f"got {tuple(weight.shape)} {weight.dtype} strides {weight.stride()}")
    packed = torch.empty(n // nr, k, nr, dtype=weight.dtype)
    advise_huge_pages(packed)  # before the pack writes it: first touch then maps 2 MB pages
    lib = load_gemm()
    pack_fn = lib.ps_gemm_bf16_pack if weight.dtype == torch.bfloat16 else lib.ps_gemm_pack
    pack_fn(weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr())
    return packed


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux


@cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask Linux for transparent huge pages under a large weight (where THP is in `madvise` mode,
    as on these machines): a decode step streams every weight once, and with 4 KB pages that is a
    TLB miss every 64 lines. Measured +8% GB/s for a one-row GEMM over weights in DRAM (5632x1024,
    20 weights rotating, same process); none at 8 or 32 rows. Best effort: nothing happens where
    it is not supported."""
    libc = _libc()
    start, size = t.data_ptr(), t.numel() * t.element_size()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + size) // HUGE_PAGE * HUGE_PAGE
    if libc is not None and last > first:
        libc.madvise(first, last - first, MADV_HUGEPAGE)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
           scratch: ScratchOutput | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with W given packed; CPU tensors, x and bias of the packed
    weight's dtype (fp32, or bf16: fp32 accumulation, the output rounded once to bf16); the
    output written into `scratch`'s tensor where one is given (pagedserve/scratch.py). Lean on
    purpose: a small decode layer's whole GEMM takes ~10 µs, so every Python step here shows
    (a tensor's stride(i) is an argument-parsed torch call, ~5 k instructions: read once)."""
    panels, k, nr = packed.shape
    n = panels * nr
    shape = x.shape
    if len(shape) != 2:
        return linear(x.reshape(-1, shape[-1]), packed, bias, scratch).reshape(*shape[:-1], n)
    m, kx = shape
    dtype = packed.dtype
    if kx != k or x.dtype != dtype or (bias is not None and (bias.shape != (n,) or bias.dtype != dtype)):
        raise ValueError(f"gemm.linear: x {tuple(x.shape)} {x.dtype} does not fit a packed [{n}, {k}] {dtype} weight")
    row_stride, col_stride = x.stride()
    if col_stride != 1:
        x = x.contiguous()
        row_stride = k
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    out = torch.empty(m, n, dtype=dtype) if scratch is None else scratch.get((m, n), dtype)
    if m:
        call = native.converted_calls(load_gemm(), _GEMMS)["ps_gemm" if dtype == torch.float32 else "ps_gemm_bf16"]
        call(x.data_ptr(), row_stride, m, k, packed.data_ptr(), n, bias.data_ptr() if bias is not None else None,
             out.data_ptr(), n, torch.get_num_threads())
    return out


_GEMMS = {"ps_gemm_bf16": None, "ps_gemm": None}  # each with its own argtypes (bind)
