"""Compiling pagedserve's C++ kernels at first use and loading them through ctypes.

The sources (attention/cpu/paged_attention.cpp, model/cpu/gemm.cpp) include no torch or Python
header, so they compile in seconds with the system compiler alone (no ninja), and a ctypes call
releases the GIL. Built at first use so that `-march=native` targets the CPU that runs them
(AVX-512, AVX2, NEON ... decided by the compiler, never assumed here).

Invariant: a cached library is only reused by a process that would have built the same one —
its file name is a hash of the source, the compiler (path and version), the flags and the CPU.
Import torch before loading one: the library's OpenMP runtime then resolves to torch's libgomp.
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
from pathlib import Path
from typing import Callable

logger = logging.getLogger("pagedserve.native")

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-std=c++17", "-shared", "-fPIC")


class NativeUnavailable(RuntimeError):
    """A kernel library cannot be built or loaded here; the message says why."""


def cache_dir() -> Path:
    if os.environ.get("PAGEDSERVE_CACHE_DIR"):
        return Path(os.environ["PAGEDSERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"


def find_compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    raise NativeUnavailable("no C++ compiler found (install g++ or set CXX)")


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
        raise NativeUnavailable(f"{compiler} --version failed: {e}") from e
    return done.stdout


def library_path(source: Path, compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    key = hashlib.sha256()
    for part in (source.read_bytes(), compiler.encode(), compiler_version(compiler).encode(),
                 " ".join(flags).encode(), cpu_identity().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:20]}.so"


def compile_library(compiler: str, source: Path, target: Path, flags: tuple[str, ...] = FLAGS) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines() or ["(no output)"]
            raise NativeUnavailable(f"{Path(compiler).name} failed to compile {source.name}: {lines[0].strip()}")
        os.replace(tmp, target)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeUnavailable(f"{Path(compiler).name} could not compile {source.name}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(source: Path, abi_version: int, bind, what: str) -> ctypes.CDLL:
    """Build `source` now unless a cached build fits, load it, declare its functions with
    `bind(lib)`, and check that its `ps_abi_version()` is `abi_version`."""
    compiler = find_compiler()
    path = library_path(source, compiler)
    if not path.exists():
        logger.info("compiling the %s for this machine (once; cached as %s)", what, path)
        compile_library(compiler, source, path)
    try:
        lib = ctypes.CDLL(str(path))
        lib.ps_abi_version.restype = ctypes.c_int
        bind(lib)
    except (OSError, AttributeError) as e:
        raise NativeUnavailable(f"cannot load {path}: {e}") from e
    if lib.ps_abi_version() != abi_version:
        raise NativeUnavailable(f"{path} has ABI {lib.ps_abi_version()}, expected {abi_version}")
    return lib


def env_choice(env: str, choices: tuple[str, ...]) -> str:
    """The value of the backend variable `env` (unset or empty: 'auto'), refused by name unless
    it is one of `choices`."""
    choice = os.environ.get(env, "auto").strip().lower() or "auto"
    if choice not in choices:
        raise ValueError(f"{env}={choice!r}: expected one of {', '.join(choices)}")
    return choice


def cpu_or_torch(env: str, choice: str, device_type: str, load: Callable[[], object], what: str,
                 log: logging.Logger) -> str:
    """'cpu' (a compiled kernel library) or 'torch' (its reference), for tensors on `device_type`:
    the decision behind PAGEDSERVE_ATTENTION_BACKEND and PAGEDSERVE_FUSED_OPS. `choice` is the
    variable's validated value, auto | cpu | torch. Forced `cpu` that cannot run is an error
    naming `env`; `auto` falls back to torch with one warning on `log` saying why."""
    if device_type != "cpu":
        if choice == "cpu":
            raise ValueError(f"{env}=cpu runs on CPU tensors only, but the model is on {device_type}")
        return "torch"
    if choice == "torch":
        return "torch"
    try:
        load()
    except NativeUnavailable as e:
        if choice == "cpu":
            raise RuntimeError(f"{env}=cpu, but the {what} cannot be used: {e}") from e
        log.warning("%s unavailable, using the torch reference: %s", what, e)
        return "torch"
    return "cpu"


class ConvertedArgs:
    """`fn(*args)` for a ctypes function with `argtypes`, converting a tuple of argument values
    to ctypes objects once it has been seen twice, and reusing them after.

    ctypes converts a Python int or float through the argument type's `from_param`, a new
    ctypes object per argument per call: ~7 k of the ~19 k instructions of a 256-float RMSNorm
    call (11 arguments; callgrind, same process). A call site whose tensors stay put (the
    shapes, the strides, a weight's address, and an activation kept in a pagedserve.scratch
    buffer) passes the same values step after step, so the converted tuple is looked up by
    the values. The key is the values themselves, so a reused address means the same pointer:
    nothing goes stale. A tuple seen once is passed as it is (a fresh tensor's address seldom
    recurs; converting and keeping it would only feed the garbage collector), and remembered;
    at its second sighting it is converted and kept. Both tables are bounded (dropped at
    `limit`). `raw` leading arguments are passed as they are (ctypes objects made by the
    caller, e.g. a byref), outside the key."""

    __slots__ = ("fn", "types", "table", "seen", "limit")

    def __init__(self, fn, raw: int = 0, limit: int = 1024, argtypes=None) -> None:
        self.fn, self.limit = fn, limit
        self.types = tuple((fn.argtypes if argtypes is None else argtypes)[raw:])
        self.table: dict[tuple, tuple] = {}
        self.seen: set[tuple] = set()

    def _miss(self, raw: tuple, args: tuple):
        seen = self.seen
        if args not in seen:
            if len(seen) >= self.limit:
                seen.clear()
            seen.add(args)
            return self.fn(*raw, *args)
        table = self.table
        if len(table) >= self.limit:
            table.clear()
        converted = table[args] = tuple(t(a) for t, a in zip(self.types, args, strict=True))
        return self.fn(*raw, *converted)

    def __call__(self, *args):
        converted = self.table.get(args)
        if converted is None:
            return self._miss((), args)
        return self.fn(*converted)

    def call_raw(self, raw: tuple, *args):
        """fn(*raw, *args): `raw` the leading ctypes objects, `args` converted as above."""
        converted = self.table.get(args)
        if converted is None:
            return self._miss(raw, args)
        return self.fn(*raw, *converted)


_CONVERTED: dict[int, tuple[object, dict[str, ConvertedArgs]]] = {}


def converted_calls(lib, argtypes: dict[str, list | None]) -> dict[str, ConvertedArgs]:
    """{name: ConvertedArgs(lib.name)} for a loaded library, made once per library object (a
    benchmark may swap builds, a test a stand-in): the GEMM's and the fused ops' call tables.
    `argtypes[name]` None: the function's own argtypes."""
    entry = _CONVERTED.get(id(lib))
    if entry is None or entry[0] is not lib:
        entry = _CONVERTED[id(lib)] = (lib, {name: ConvertedArgs(getattr(lib, name), argtypes=types)
                                             for name, types in argtypes.items()})
    return entry[1]
