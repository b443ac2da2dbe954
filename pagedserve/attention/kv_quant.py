"""A quantized KV cache (`kv_cache_dtype`): K and V stored in one byte per value, with scales.

Formats, by vLLM's names:

- `fp8_e4m3` (`fp8`): OCP FP8 E4M3 (exponent bias 7, largest 448, no infinities), with one scale
  per layer for K and one for V (vLLM's per-tensor scheme): stored = fp8(clamp(x / scale)),
  read = the fp8 value x scale.
- `fp8_e5m2`: FP8 E5M2 (bias 15, largest 57344; two mantissa bits), the same per-tensor scales.
- `int8`: one fp32 scale per token and KV head, scale = max|x| / 127 over the head's values,
  stored = round(x / scale). Those scales cost 4 bytes per token, head and K-or-V
  (`plan.kv_budget.kv_scale_bytes`), which the pool sizing counts.

The per-tensor fp8 scales are 1.0, vLLM's default when a checkpoint carries none (pagedserve
reads no scales from checkpoints). Why not a calibrated amax / 448: on the built-in model the
held-out perplexity is the same either way (+0.04% with 1.0, +0.07% with per-layer amax / 448
from the training split; benchmarks/README.md, "Quantized KV cache"), since E4M3 keeps three
mantissa bits over its whole normal range [2^-6, 448] and 1-4% of that model's K/V values fall
below it; a scale fitted to a calibration set would also clip whatever later exceeds it.
A scale can be set (`QuantizedKVCache.set_tensor_scales`) only while nothing is stored.

Invariants:
- Attention sees every key and value as stored, dequantize(quantize(x)): also a prefill chunk's
  own new tokens (`as_stored`), so a prompt's numbers do not depend on how it was chunked, on a
  prefix-cache hit, or on a preemption.
- A token's scales live at its slot, in a tensor laid out as the values minus head_dim
  ([layers, 2, num_slots, kv_heads]): copying a block (swap) or sharing it (prefix cache) takes
  its scales along with it (`QuantizedKVCache.tensors`).
- A per-tensor scale never changes while the pool holds values: each value is read with the
  scale it was written with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class KVFormat:
    name: str
    storage: torch.dtype          # the pool tensor's element type
    fp8: torch.dtype | None       # the float8 type its bytes are (fp8 formats)
    max_value: float              # the largest magnitude it stores
    per_token_scales: bool        # int8: a scale per (slot, kv head); fp8: one per layer and K/V
    kernel_code: int              # the CPU kernel's dtype code (attention/cpu/paged_attention.cpp)


FORMATS = {
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.uint8, torch.float8_e4m3fn, 448.0, False, 3),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.uint8, torch.float8_e5m2, 57344.0, False, 4),
    "int8": KVFormat("int8", torch.int8, None, 127.0, True, 5),
}


def kv_format(kv_dtype: str | None) -> KVFormat | None:
    """The format of a resolved KV dtype name; None for a plain (compute-dtype) cache."""
    if kv_dtype == "fp8":
        kv_dtype = "fp8_e4m3"
    return FORMATS.get(kv_dtype) if kv_dtype else None


# -- quantize / dequantize -----------------------------------------------------------------
def quantize(x: torch.Tensor, fmt: KVFormat, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., head_dim] -> (values in fmt.storage, per-token-head scales [...] fp32 or None)."""
    x32 = x.float()
    if fmt.per_token_scales:
        amax = x32.abs().amax(dim=-1)
        # An all-zero head stores zeros; any positive scale reads them back as zeros.
        scales = torch.where(amax > 0, amax / fmt.max_value, torch.ones_like(amax))
        q = torch.round(x32 / scales.unsqueeze(-1)).clamp_(-fmt.max_value, fmt.max_value)
        return q.to(torch.int8), scales
    if scale != 1.0:
        x32 = x32 / scale
    # Clamp first: casting past the largest finite value is NaN for e4m3fn on some devices.
    q = x32.clamp(-fmt.max_value, fmt.max_value).to(fmt.fp8)
    return q.view(torch.uint8), None


def dequantize(values: torch.Tensor, scales: torch.Tensor | None, fmt: KVFormat, scale: float,
               dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize`, computed in fp32 and returned in `dtype`."""
    if fmt.per_token_scales:
        return (values.float() * scales.unsqueeze(-1)).to(dtype)
    x = values.view(fmt.fp8).float()
    if scale != 1.0:
        x = x * scale
    return x.to(dtype)


# -- the pool ------------------------------------------------------------------------------
@dataclass
class QuantizedKV:
    """One layer's K (or V) pool: what the model hands `paged_attention` as k_cache / v_cache."""

    values: torch.Tensor             # [num_slots, kv_heads, head_dim] fmt.storage
    scales: torch.Tensor | None      # [num_slots, kv_heads] fp32 (int8); None for fp8
    scale: float                     # the per-tensor scale (fp8); 1.0 for int8
    fmt: KVFormat

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device


class QuantizedKVCache:
    """The runner's pool in a quantized format: values [layers, 2, num_slots, kv_heads, head_dim]
    and, for int8, scales [layers, 2, num_slots, kv_heads]. `pool[layer, 0]` is the layer's K
    (a QuantizedKV), `pool[layer, 1]` its V, as the model indexes a plain pool tensor."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor | None, fmt: KVFormat) -> None:
        self.values = values
        self.scales = scales
        self.fmt = fmt
        self.tensor_scales = [[1.0, 1.0] for _ in range(values.shape[0])]  # [layer][K, V]

    @classmethod
    def allocate(cls, shape: tuple, fmt: KVFormat, device: torch.device,
                 allocate: Callable[[tuple, torch.dtype, torch.device], torch.Tensor]) -> "QuantizedKVCache":
        """`allocate(shape, dtype, device)` makes a zeroed tensor (the runner's allocate_zeroed)."""
        values = allocate(shape, fmt.storage, device)
        scales = allocate(shape[:-1], torch.float32, device) if fmt.per_token_scales else None
        return cls(values, scales, fmt)

    def __getitem__(self, index: tuple[int, int]) -> QuantizedKV:
        layer, which = index
        scales = self.scales[layer, which] if self.scales is not None else None
        return QuantizedKV(self.values[layer, which], scales, self.tensor_scales[layer][which], self.fmt)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed [layers, 2, num_slots, ...]: a block copy moves the same slots of each."""
        return [self.values] if self.scales is None else [self.values, self.scales]

    def pin_memory(self) -> "QuantizedKVCache":
        pinned = QuantizedKVCache(self.values.pin_memory(),
                                  None if self.scales is None else self.scales.pin_memory(), self.fmt)
        pinned.tensor_scales = [list(s) for s in self.tensor_scales]
        return pinned

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def set_tensor_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        """Per-layer fp8 scales (K, V). Only before anything is stored: a value must be read
        with the scale it was written with."""
        if self.fmt.per_token_scales:
            raise ValueError(f"kv_cache_dtype {self.fmt.name} keeps a scale per token and head, not per tensor")
        if len(k_scales) != len(self.tensor_scales) or len(v_scales) != len(self.tensor_scales):
            raise ValueError(f"kv scales: need {len(self.tensor_scales)} per layer for K and V")
        if any(not s > 0 for s in (*k_scales, *v_scales)):
            raise ValueError("kv scales: each must be > 0")
        if bool(self.values.any()):
            raise ValueError("kv scales: the pool already holds values written with the current scales")
        self.tensor_scales = [[float(k), float(v)] for k, v in zip(k_scales, v_scales)]


# -- what the attention backends call ------------------------------------------------------
KVCacheLayer = torch.Tensor | QuantizedKV


def store(cache: KVCacheLayer, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """cache[slot_mapping[t]] = x[t] (quantized when the cache is)."""
    if not isinstance(cache, QuantizedKV):
        cache.index_copy_(0, slot_mapping, x)
        return
    q, scales = quantize(x, cache.fmt, cache.scale)
    cache.values.index_copy_(0, slot_mapping, q)
    if scales is not None:
        cache.scales.index_copy_(0, slot_mapping, scales)


def as_stored(cache: KVCacheLayer, x: torch.Tensor) -> torch.Tensor:
    """x as attention reads it back from `cache`: x itself for a plain cache."""
    if not isinstance(cache, QuantizedKV):
        return x
    q, scales = quantize(x, cache.fmt, cache.scale)
    return dequantize(q, scales, cache.fmt, cache.scale, x.dtype)


def gather_slot_blocks(t: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """t [num_slots, *rest] -> [*blocks.shape[:-1], n * block_size, *rest]: whole blocks at a time."""
    num_slots, rest = t.shape[0], t.shape[1:]
    rows = t.view(num_slots // block_size, -1).index_select(0, blocks.reshape(-1))
    return rows.view(*blocks.shape[:-1], blocks.shape[-1] * block_size, *rest)


def read_blocks(cache: KVCacheLayer, blocks: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The K or V of `blocks` ([..., n] ids) as [..., n * block_size, kv_heads, head_dim] in `dtype`."""
    if not isinstance(cache, QuantizedKV):
        return gather_slot_blocks(cache, blocks, block_size)
    values = gather_slot_blocks(cache.values, blocks, block_size)
    scales = gather_slot_blocks(cache.scales, blocks, block_size) if cache.scales is not None else None
    return dequantize(values, scales, cache.fmt, cache.scale, dtype)
