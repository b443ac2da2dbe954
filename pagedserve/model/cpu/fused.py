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
differ; SiLU uses, element by element, the exp torch's F.silu uses on HF's contiguous gate:
`torch_vector_exp`); a call whose tensors the kernels do not take (dtype other than fp32 / bf16, mixed
dtypes, a last dim that is not contiguous, other ranks) takes the reference path, per call.
`add_rms_norm` and `apply_rotary` may update their inputs in place (the kernels do, the
reference does not): callers use the returned tensors and do not read the inputs again.
"""
from __future__ import annotations

import ctypes
import logging
import os
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve import native
from pagedserve.scratch import ScratchOutput

logger = logging.getLogger("pagedserve.model.fused")

SOURCE = Path(__file__).with_name("fused.cpp")
ABI_VERSION = 2
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
_c_int, _i64, _ptr, _c_float = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
KERNEL_ARGTYPES = {
    "ps_rms_norm": [_c_int, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _c_float, _c_int, _c_int],
    "ps_add_rms_norm": [_c_int, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _c_float, _c_int, _c_int],
    "ps_silu_and_mul": [_c_int, _ptr, _i64, _ptr, _i64, _i64, _i64, _c_int],
    "ps_rotary": [_c_int, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _c_int],
}


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, argtypes in KERNEL_ARGTYPES.items():
        getattr(lib, name).argtypes = argtypes
    ptr, i64, c_int = _ptr, _i64, _c_int
    lib.ps_sum_of_squares.argtypes = [ptr, i64, c_int]
    lib.ps_sum_of_squares.restype = ctypes.c_float
    lib.ps_set_vector_exp.argtypes = [c_int, ptr]
    lib.ps_set_vector_exp.restype = c_int
    for fn in (lib.ps_rms_norm, lib.ps_add_rms_norm, lib.ps_silu_and_mul, lib.ps_rotary):
        fn.restype = c_int
    return lib


@cache
def load_library() -> ctypes.CDLL:
    """The compiled kernels (built now if no cached build fits), given torch's vectorised exp
    (`torch_vector_exp`); NativeUnavailable says why not."""
    lib = native.load_library(SOURCE, ABI_VERSION, bind, "CPU fused elementwise ops")
    lanes, address = torch_vector_exp()
    if lib.ps_set_vector_exp(lanes, address) != 0:
        logger.info("this build of fused.cpp cannot call a %d-float vector exp; SiLU uses std::exp "
                    "(it may differ from torch's vectorised F.silu by an ulp)", lanes)
        lib.ps_set_vector_exp(0, None)
    return lib


# The SLEEF function torch's Vectorized<float>::exp() calls under each CPU capability
# (ATen/cpu/vec/vec512/vec512_float.h, vec256/vec256_float.h), and its float lanes.
VECTOR_EXP_SYMBOLS = {"AVX512": ("Sleef_expf16_u10", 16), "AVX2": ("Sleef_expf8_u10", 8)}


@cache
def torch_vector_exp() -> tuple[int, int | None]:
    """(lanes, address) of the exp torch's vectorised SiLU uses in this process, resolved in the
    loaded libtorch_cpu (no link-time dependency on torch): SiLU in fused.cpp then equals
    F.silu bit for bit. (0, None) where every exp is std::exp: under the DEFAULT capability
    (torch's generic Vectorized maps std::exp, so the scalar path is already torch's), and
    where the symbol cannot be found (another torch build, another CPU family), said once."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "DEFAULT":
        return 0, None
    if capability not in VECTOR_EXP_SYMBOLS:
        logger.info("torch's CPU capability is %s; SiLU uses std::exp, which may differ from torch's "
                    "vectorised F.silu by an ulp", capability)
        return 0, None
    name, lanes = VECTOR_EXP_SYMBOLS[capability]
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        # RTLD_NOLOAD: the copy torch already loaded, or nothing.
        libtorch = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        address = ctypes.cast(getattr(libtorch, name), ctypes.c_void_p).value
    except (OSError, AttributeError) as e:
        logger.info("%s not found in %s (%s); SiLU uses std::exp, which may differ from torch's "
                    "vectorised F.silu by an ulp", name, path, e)
        return 0, None
    return lanes, address


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
    """The kernels' dtype code when they serve these tensors (all CPU, one dtype), else None.
    The callers check the strides they need (each `stride()` is an argument-parsed torch call,
    so each tensor's is read once)."""
    first = tensors[0]
    dtype = first.dtype
    code = DTYPE_CODES.get(dtype)
    if code is None or fused_ops_for("cpu") != "cpu":
        return None
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu:
            return None
    return code


def _calls() -> dict[str, native.ConvertedArgs]:
    """The kernels of `load_library()`, each converting its arguments once per distinct tuple
    (native.converted_calls; per library object: tests count the calls through a stand-in)."""
    return native.converted_calls(load_library(), KERNEL_ARGTYPES)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, scratch: ScratchOutput | None = None) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) in fp32 rounded to x's dtype; x [T, H]. The kernels
    write into `scratch`'s tensor where one is given (pagedserve/scratch.py), as do the others."""
    code = _code(x, weight)
    shape = x.shape
    if code is None or len(shape) != 2 or weight.dim() != 1 or weight.shape[0] != shape[1]:
        return rms_norm_reference(x, weight, eps)
    x_stride = x.stride()
    if x_stride[1] != 1 or weight.stride()[0] != 1:
        return rms_norm_reference(x, weight, eps)
    rows, cols = shape
    out = torch.empty(rows, cols, dtype=x.dtype) if scratch is None else scratch.get((rows, cols), x.dtype)
    _calls()["ps_rms_norm"](code, x.data_ptr(), x_stride[0], weight.data_ptr(), out.data_ptr(), cols, rows, cols,
                            eps, torch_sum_lanes(), torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 scratch: ScratchOutput | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); the kernel adds into `residual` in place."""
    code = _code(x, residual, weight)
    shape = x.shape
    if (code is None or len(shape) != 2 or shape != residual.shape or weight.dim() != 1
            or weight.shape[0] != shape[1]):
        return add_rms_norm_reference(x, residual, weight, eps)
    x_stride, res_stride = x.stride(), residual.stride()
    if x_stride[1] != 1 or res_stride[1] != 1 or weight.stride()[0] != 1:
        return add_rms_norm_reference(x, residual, weight, eps)
    rows, cols = shape
    out = torch.empty(rows, cols, dtype=x.dtype) if scratch is None else scratch.get((rows, cols), x.dtype)
    _calls()["ps_add_rms_norm"](code, x.data_ptr(), x_stride[0], residual.data_ptr(), res_stride[0],
                                weight.data_ptr(), out.data_ptr(), cols, rows, cols, eps, torch_sum_lanes(),
                                torch.get_num_threads())
    return out, residual


def silu_and_mul(x: torch.Tensor, scratch: ScratchOutput | None = None) -> torch.Tensor:
    """x [T, 2I] (gate columns, then up) -> silu(gate) * up [T, I]."""
    code = _code(x)
    shape = x.shape
    if code is None or len(shape) != 2 or shape[1] % 2:
        return silu_and_mul_reference(x)
    x_stride = x.stride()
    if x_stride[1] != 1:
        return silu_and_mul_reference(x)
    rows, inter = shape[0], shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype) if scratch is None else scratch.get((rows, inter), x.dtype)
    _calls()["ps_silu_and_mul"](code, x.data_ptr(), x_stride[0], out.data_ptr(), inter, rows, inter,
                                torch.get_num_threads())
    return out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KV, D], cos / sin [T, 1, D] or [T, D]: x * cos + rotate_half(x) * sin
    for each (neox layout: element i pairs with i + D/2); the kernel rotates q and k in place."""
    code = _code(q, k, cos, sin)
    if code is None:
        return apply_rotary_reference(q, k, cos, sin)
    q_stride, k_stride, cos_stride = q.stride(), k.stride(), cos.stride()
    if (q_stride[-1] != 1 or k_stride[-1] != 1 or cos_stride[-1] != 1
            or not _rotary_shapes_fit(q, k, cos, sin, cos_stride)):
        return apply_rotary_reference(q, k, cos, sin)
    rows, heads, head_dim = q.shape
    _calls()["ps_rotary"](code, q.data_ptr(), q_stride[0], q_stride[1], heads, k.data_ptr(), k_stride[0],
                          k_stride[1], k.shape[1], cos.data_ptr(), cos_stride[0], sin.data_ptr(), cos_stride[0],
                          rows, head_dim, torch.get_num_threads())
    return q, k


def _rotary_shapes_fit(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cos_stride: tuple[int, ...]) -> bool:
    if q.dim() != 3 or k.dim() != 3:
        return False
    rows, _, head_dim = q.shape
    return k.shape[0] == rows and k.shape[2] == head_dim and rotary_table_fits(rows, head_dim, cos, sin, cos_stride)


def rotary_table_fits(rows: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                      cos_stride: tuple[int, ...]) -> bool:
    """Whether the kernel takes these cos / sin rows for `rows` tokens of `head_dim` (the table's part of
    apply_rotary's check; model/cpu/decoder.py asks it before its one native call)."""
    if cos.shape != sin.shape or cos_stride != sin.stride() or head_dim % 2:
        return False
    table_shape = (rows, 1, head_dim) if cos.dim() == 3 else (rows, head_dim)
    return tuple(cos.shape) == table_shape
