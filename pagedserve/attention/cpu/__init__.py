"""The CPU paged-attention kernel: C++ source compiled at first use, loaded through ctypes
(pagedserve/native.py says how and why)."""
from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

from pagedserve import native
from pagedserve.native import NativeUnavailable as KernelUnavailable
from pagedserve.native import find_compiler

__all__ = ["KernelUnavailable", "find_compiler", "load_kernel", "library_path"]

SOURCE = Path(__file__).with_name("paged_attention.cpp")
ABI_VERSION = 6
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}  # quantized caches: kv_quant.KVFormat.kernel_code


class AttentionPlan(ctypes.Structure):
    """Mirror of PsAttentionPlan in paged_attention.cpp (same field order and types)."""
    _fields_ = [
        ("num_seqs", ctypes.c_int64),
        ("q_start", ctypes.c_void_p),
        ("q_len", ctypes.c_void_p),
        ("ctx_len", ctypes.c_void_p),
        ("block_table", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("sliding_window", ctypes.c_int64),
    ]


def library_path(compiler: str) -> Path:
    return native.library_path(SOURCE, compiler)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    c_int, c_i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.ps_dtype_supported.argtypes = [c_int]
    lib.ps_dtype_supported.restype = c_int
    c_float = ctypes.c_float
    lib.ps_paged_attention.argtypes = [ctypes.POINTER(AttentionPlan), ptr, c_i64, c_int, ptr, ptr, c_i64, c_i64, c_i64,
                                       c_int, ptr, c_i64, c_i64, c_i64, c_i64, c_float, ptr, ptr, c_i64, c_float,
                                       c_float, c_int]
    lib.ps_paged_attention.restype = c_int
    lib.ps_write_kv.argtypes = [ptr, c_i64, ptr, c_i64, ptr, ptr, c_i64, ptr, c_i64, c_i64, c_int]
    lib.ps_write_kv.restype = None
    lib.ps_attention_layer.argtypes = [ctypes.POINTER(AttentionPlan), ptr, c_i64, ptr, c_i64, ptr, c_i64, ptr, c_i64,
                                       ptr, c_i64, ptr, ptr, c_i64, c_i64, c_i64, c_int, c_i64, c_i64, c_i64,
                                       ctypes.c_float, c_int]
    lib.ps_attention_layer.restype = c_int
    lib.ps_fresh_prefill.argtypes = [c_i64, ptr, ptr, ptr, c_i64, ptr, c_i64, ptr, c_i64, ptr, c_i64, c_int, c_i64,
                                     c_i64, c_i64, c_float, c_int]
    lib.ps_fresh_prefill.restype = c_int
    lib.ps_cached_prefill.argtypes = [ctypes.POINTER(AttentionPlan), ptr, c_i64, ptr, ptr, c_i64, c_i64, c_i64, ptr,
                                      c_i64, c_int, c_i64, c_i64, c_i64, c_float, c_int]
    lib.ps_cached_prefill.restype = c_int
    return lib


@cache
def load_kernel() -> ctypes.CDLL:
    """The compiled kernel (built now if no cached build fits); KernelUnavailable says why not."""
    return native.load_library(SOURCE, ABI_VERSION, bind, "CPU attention kernel")
