"""What this CPU can do, probed once at run time (never assumed from the build or the host name).

Invariant: `cpu_features()` reports a flag only if the running CPU (and kernel) advertise it;
on a machine where nothing can be read every flag is False, so callers fall back to the
safe path (fp32, plain torch GEMMs). The module imports no torch at import time: the dtype
rule in pagedserve.config uses it and stays torch-free.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuFeatures:
    avx2: bool = False
    avx512f: bool = False
    avx512_bf16: bool = False
    amx_bf16: bool = False
    amx_tile: bool = False

    @property
    def fast_bf16(self) -> bool:
        """bf16 GEMMs run in hardware: AVX512-BF16 dot products, or AMX tiles."""
        return self.avx512_bf16 or (self.amx_bf16 and self.amx_tile)

    def describe(self) -> str:
        names = [name for name in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if getattr(self, name)]
        return "+".join(names) or "no AVX2"


def parse_cpuinfo_flags(text: str) -> frozenset[str]:
    """The `flags` line of /proc/cpuinfo (x86 Linux) as a set; empty if there is none."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def features_from_flags(flags: frozenset[str]) -> CpuFeatures:
    return CpuFeatures(avx2="avx2" in flags, avx512f="avx512f" in flags, avx512_bf16="avx512_bf16" in flags,
                       amx_bf16="amx_bf16" in flags, amx_tile="amx_tile" in flags)


def _features_from_torch() -> CpuFeatures:
    """Where /proc/cpuinfo is missing (not Linux), ask torch's own cpuinfo-based probes."""
    try:
        import torch.cpu as tc

        return CpuFeatures(avx2=bool(tc._is_avx2_supported()), avx512f=bool(tc._is_avx512_supported()),
                           avx512_bf16=bool(tc._is_avx512_bf16_supported()),
                           amx_bf16=bool(tc._is_amx_tile_supported()), amx_tile=bool(tc._is_amx_tile_supported()))
    except (ImportError, AttributeError, RuntimeError):
        return CpuFeatures()


@functools.lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    try:
        flags = parse_cpuinfo_flags(CPUINFO.read_text())
    except OSError:
        flags = frozenset()
    return features_from_flags(flags) if flags else _features_from_torch()
