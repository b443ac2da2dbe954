"""The decoder layer's elementwise ops (RMSNorm, residual add + RMSNorm, SiLU(gate) * up, rotary
embedding), each one call into fused.cpp on CPU tensors, or the torch reference expressions.

At decode sizes each torch op costs its dispatch (3-10 us) and little else; a layer runs ~45 of
them, so on a small model they are a third of a step. One fused call per op group removes that.

Which path serves is decided once per process and device type (`fused_ops_for`):
- `cpu`: the compiled kernels, chosen by default for CPU tensors when fused.cpp builds; where it
  cannot (no compiler, a build error) one warning says why and the torch reference serves.
- `torch`: the reference expressions below, always used on other devices.
PAGEDSERVE_FUSED_OPS=auto|cpu|torch forces the choice; a forced `cpu` that cannot run is an
error, not a fallback (as PAGEDSERVE_ATTENTION_BACKEND in pagedserve/attention).

Invariants: the kernels round as the reference does (fused.cpp says where an fp32 ulp may
differ); a call whose tensors the kernels do not take (dtype other than fp32 / bf16, mixed
dtypes, a last dim that is not contiguous, other ranks) takes the reference path, per call.
`add_rms_norm` and `apply_rotary` may update their inputs in place (the kernels do, the
reference does not): callers use the returned tensors and do not read the inputs again.
"""
from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve import native

logger = logging.getLogger("pagedserve.model.fused")

SOURCE = Path(__file__).with_name("fused.cpp")
ABI_VERSION = 1
FUSED_ENV = "PAGEDSERVE_FUSED_OPS"
FUSED_CHOICES = ("auto", "cpu", "torch")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


# -- the torch reference --------------------------------------------------------------------------
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return rms_norm_reference(residual, weight, eps), residual


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# -- the compiled kernels -------------------------------------------------------------------------
def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    c_int, i64, ptr, c_float = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.ps_rms_norm.argtypes = [c_int, ptr, i64, ptr, ptr, i64, i64, i64, c_float, c_int, c_int]
    lib.ps_add_rms_norm.argtypes = [c_int, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, c_float, c_int, c_int]
    lib.ps_silu_and_mul.argtypes = [c_int, ptr, i64, ptr, i64, i64, i64, c_int]
    lib.ps_rotary.argtypes = [c_int, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, i64, c_int]
    lib.ps_sum_of_squares.argtypes = [ptr, i64, c_int]
    lib.ps_sum_of_squares.restype = ctypes.c_float
    for fn in (lib.ps_rms_norm, lib.ps_add_rms_norm, lib.ps_silu_and_mul, lib.ps_rotary):
        fn.restype = c_int
    return lib


@cache
def load_library() -> ctypes.CDLL:
    """The compiled kernels (built now if no cached build fits); NativeUnavailable says why not."""
    return native.load_library(SOURCE, ABI_VERSION, bind, "CPU fused elementwise ops")


@cache
def torch_sum_lanes() -> int:
    """Floats per vector in torch's sum kernel in this process (16, 8 or 4: it depends on the
    torch build and the CPU, and is not always the widest the CPU has). The RMSNorm kernel adds
    its squares in that order so its mean equals torch's bit for bit; found by comparing the
    kernel's sums with torch's on a probe. Where none matches, 8 (then means differ from
    torch's by rounding only, and one debug line says so)."""
    lib = load_library()
    probe = torch.randn(4, 1003, generator=torch.Generator().manual_seed(0))
    want = probe.pow(2).sum(-1).tolist()
    for lanes in (16, 8, 4):
        if all(lib.ps_sum_of_squares(row.data_ptr(), row.numel(), lanes) == w for row, w in zip(probe, want)):
            return lanes
    logger.debug("no vector width reproduces torch's sum order here; RMSNorm means may differ by an ulp")
    return 8


@cache
def fused_ops_for(device_type: str) -> str:
    """'cpu' (the compiled kernels) or 'torch' for tensors on `device_type`; decided once."""
    choice = native.env_choice(FUSED_ENV, FUSED_CHOICES)
    return native.cpu_or_torch(FUSED_ENV, choice, device_type, load_library, "CPU fused elementwise ops", logger)


def _code(*tensors: torch.Tensor) -> int | None:
    """The kernels' dtype code when they serve these tensors (all CPU, one dtype, the last dim
    contiguous), else None."""
    first = tensors[0]
    code = DTYPE_CODES.get(first.dtype)
    if code is None or not first.is_cpu or fused_ops_for("cpu") != "cpu":
        return None
    for t in tensors:
        if t.dtype != first.dtype or not t.is_cpu or t.stride(-1) != 1:
            return None
    return code


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) in fp32 rounded to x's dtype; x [T, H]."""
    code = _code(x, weight)
    if code is None or x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        return rms_norm_reference(x, weight, eps)
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype)
    load_library().ps_rms_norm(code, x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), cols, rows, cols,
                               eps, torch_sum_lanes(), torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); the kernel adds into `residual` in place."""
    code = _code(x, residual, weight)
    if (code is None or x.dim() != 2 or x.shape != residual.shape or weight.dim() != 1
            or weight.shape[0] != x.shape[1]):
        return add_rms_norm_reference(x, residual, weight, eps)
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype)
    load_library().ps_add_rms_norm(code, x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                                   weight.data_ptr(), out.data_ptr(), cols, rows, cols, eps, torch_sum_lanes(),
                                   torch.get_num_threads())
    return out, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate columns, then up) -> silu(gate) * up [T, I]."""
    code = _code(x)
    if code is None or x.dim() != 2 or x.shape[1] % 2:
        return silu_and_mul_reference(x)
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype)
    load_library().ps_silu_and_mul(code, x.data_ptr(), x.stride(0), out.data_ptr(), inter, rows, inter,
                                   torch.get_num_threads())
    return out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KV, D], cos / sin [T, 1, D] or [T, D]: x * cos + rotate_half(x) * sin
    for each (neox layout: element i pairs with i + D/2); the kernel rotates q and k in place."""
    code = _code(q, k, cos, sin)
    if code is None or not _rotary_shapes_fit(q, k, cos, sin):
        return apply_rotary_reference(q, k, cos, sin)
    rows, heads, head_dim = q.shape
    load_library().ps_rotary(code, q.data_ptr(), q.stride(0), q.stride(1), heads, k.data_ptr(), k.stride(0),
                             k.stride(1), k.shape[1], cos.data_ptr(), cos.stride(0), sin.data_ptr(), sin.stride(0),
                             rows, head_dim, torch.get_num_threads())
    return q, k


def _rotary_shapes_fit(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if q.dim() != 3 or k.dim() != 3 or cos.shape != sin.shape or cos.stride() != sin.stride():
        return False
    rows, _, head_dim = q.shape
    table_shape = (rows, 1, head_dim) if cos.dim() == 3 else (rows, head_dim)
    return (head_dim % 2 == 0 and k.shape[0] == rows and k.shape[2] == head_dim
            and tuple(cos.shape) == table_shape)
