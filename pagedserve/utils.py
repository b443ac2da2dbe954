"""Small helpers shared across packages."""
from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(value: int | float | str) -> int:
    """'4GiB' -> 4*2**30, '30GB' -> 30e9, 123 -> 123. Bad input -> ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"not a byte size: {value!r}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {value!r} (use e.g. 123, '512MiB', '4GiB', '30GB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def json_safe(value):
    """NaN and infinities as null / "inf", so result files are strict JSON."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
