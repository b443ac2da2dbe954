"""The CPU paged-attention kernel: C++ source compiled at first use, loaded through ctypes.

Why ctypes and not torch's extension tooling: the source includes no torch header, so it
compiles in seconds with the system compiler alone (no ninja, no Python headers), and a ctypes
call releases the GIL. Why at first use: `-march=native` then targets the CPU that runs it
(AVX-512, AVX2, NEON ... decided by the compiler, never assumed here).

Invariant: a cached library is only reused by a process that would have built the same one —
its file name is a hash of the source, the compiler (path and version), the flags and the CPU.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

logger = logging.getLogger("pagedserve.attention")

SOURCE = Path(__file__).with_name("paged_attention.cpp")
ABI_VERSION = 4
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-std=c++17", "-shared", "-fPIC")
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}  # quantized caches: kv_quant.KVFormat.kernel_code


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why."""


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


def cache_dir() -> Path:
    if os.environ.get("PAGEDSERVE_CACHE_DIR"):
        return Path(os.environ["PAGEDSERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"


def find_compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    raise KernelUnavailable("no C++ compiler found (install g++ or set CXX)")


def cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        first = text.split("\n\n", 1)[0]
        keep = [line for line in first.splitlines() if line.split(":")[0].strip() in ("model name", "flags", "Features")]
        return "\n".join(keep)
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{compiler} --version failed: {e}") from e
    return done.stdout


def library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), compiler.encode(), compiler_version(compiler).encode(),
                 " ".join(FLAGS).encode(), cpu_identity().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"paged_attention-{key.hexdigest()[:20]}.so"


def compile_library(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines() or ["(no output)"]
            raise KernelUnavailable(f"{Path(compiler).name} failed to compile {SOURCE.name}: {lines[0].strip()}")
        os.replace(tmp, target)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{Path(compiler).name} could not compile {SOURCE.name}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    c_int, c_i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.ps_abi_version.restype = c_int
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
    return lib


@cache
def load_kernel() -> ctypes.CDLL:
    """The compiled kernel (built now if no cached build fits); KernelUnavailable says why not.

    Import torch first: the library's OpenMP runtime then resolves to the one torch loaded.
    """
    compiler = find_compiler()
    path = library_path(compiler)
    if not path.exists():
        logger.info("compiling the CPU attention kernel for this machine (once; cached as %s)", path)
        compile_library(compiler, path)
    try:
        lib = bind(ctypes.CDLL(str(path)))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from e
    if lib.ps_abi_version() != ABI_VERSION:
        raise KernelUnavailable(f"{path} has ABI {lib.ps_abi_version()}, expected {ABI_VERSION}")
    return lib
