"""Paged attention backends: write new K/V into the block pool by slot, attend through
each request's block table.

The model and the runner call `build_metadata` and `paged_attention` from here; which backend
serves them is decided once per process and device type (`backend_for`):

- `cpu`: the compiled kernel in attention/cpu (reads K/V in place), chosen by default for CPU
  tensors when it builds; where it cannot (no compiler, a build error) one warning says why
  and the torch reference serves instead.
- `triton`: Triton kernels (triton_backend), chosen by default for CUDA tensors when triton
  imports and its kernels pass a small self-check on the device against the reference; where
  they do not, one warning says why and the torch reference serves instead. On CPU tensors
  only under TRITON_INTERPRET=1 (the interpreter: for tests, far too slow to serve).
- `torch`: the pure-torch reference (torch_backend), for tests, and as the fallback; also what
  reads a quantized KV cache (kv_cache_dtype fp8 / int8) on CUDA, where the Triton kernels
  read plain caches only (`backend_for_cache`).

PAGEDSERVE_ATTENTION_BACKEND=auto|torch|cpu|triton forces the choice; a forced backend that
cannot run is an error, not a fallback. The metadata records which backend built it, and
`paged_attention` follows it, so one step never mixes two layouts of metadata.
"""
from __future__ import annotations

import logging
from functools import cache

import numpy as np
import torch

from pagedserve.attention import cpu_backend, torch_backend
from pagedserve import native
from pagedserve.attention.cpu import load_kernel
from pagedserve.attention.cpu_backend import KernelMetadata
from pagedserve.attention.torch_backend import AttentionMetadata as TorchMetadata
from pagedserve.scratch import ScratchOutput

logger = logging.getLogger("pagedserve.attention")

BACKEND_ENV = "PAGEDSERVE_ATTENTION_BACKEND"
BACKEND_CHOICES = ("auto", "torch", "cpu", "triton")

AttentionMetadata = TorchMetadata | KernelMetadata  # what build_metadata returns, whichever backend


@cache
def backend_for(device_type: str) -> str:
    """'cpu' (the compiled kernel), 'triton' or 'torch', for tensors on `device_type`; decided once."""
    choice = native.env_choice(BACKEND_ENV, BACKEND_CHOICES)
    if choice == "triton" or (choice == "auto" and device_type != "cpu"):
        return _triton_or_fallback(device_type, forced=choice == "triton")
    return native.cpu_or_torch(BACKEND_ENV, choice, device_type, load_kernel, "CPU attention kernel", logger)


def _triton_or_fallback(device_type: str, forced: bool) -> str:
    from pagedserve.attention.triton_check import TritonUnavailable, check_triton

    try:
        check_triton(device_type)
    except TritonUnavailable as e:
        if forced:
            raise RuntimeError(f"{BACKEND_ENV}=triton, but the Triton attention kernels cannot run: {e}") from e
        logger.warning("Triton attention kernels unavailable on %s, using the torch reference: %s", device_type, e)
        return "torch"
    return "triton"


def backend_for_cache(device_type: str, quantized_cache: bool) -> str:
    """`backend_for`, for a pool that may be quantized (kv_cache_dtype fp8 / int8): the Triton
    kernels read plain caches only, so a quantized one is read by the torch reference there (a
    forced triton backend is refused, naming both settings)."""
    backend = backend_for(device_type)
    if backend != "triton" or not quantized_cache:
        return backend
    return _torch_for_quantized_cache()


@cache
def _torch_for_quantized_cache() -> str:
    if native.env_choice(BACKEND_ENV, BACKEND_CHOICES) == "triton":
        raise ValueError(f"kv_cache_dtype: a quantized KV cache is not read by the Triton kernels, and "
                         f"{BACKEND_ENV}=triton forbids the torch reference that reads it; use "
                         f"{BACKEND_ENV}=auto or kv_cache_dtype=auto")
    logger.warning("kv_cache_dtype: the Triton kernels read plain caches only; the quantized KV cache is read "
                   "by the torch reference attention")
    return "torch"


def build_metadata(decodes: list[tuple[np.ndarray, int]], prefills: list[tuple[np.ndarray, int, int]],
                   block_size: int, sliding_window: int | None,
                   device: torch.device, quantized_cache: bool = False) -> tuple[AttentionMetadata, np.ndarray]:
    """decodes: (block_ids, position) per request; prefills: (block_ids, start_pos, q_len).
    `quantized_cache`: the pool is a kv_quant.QuantizedKVCache (see `backend_for_cache`).

    Returns the chosen backend's metadata and the positions of all tokens in layout order.
    """
    backend = backend_for_cache(torch.device(device).type, quantized_cache)
    if backend == "cpu":
        return cpu_backend.build_metadata(decodes, prefills, block_size, sliding_window, device)
    if backend == "triton":
        from pagedserve.attention import triton_backend
        return triton_backend.build_metadata(decodes, prefills, block_size, sliding_window, device)
    return torch_backend.build_metadata(decodes, prefills, block_size, sliding_window, device)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    scratch: ScratchOutput | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; k_cache/v_cache: [num_slots, KV, D] (one layer).

    Writes k/v into the cache at meta.slot_mapping, returns attention output [T, H, D] (the CPU
    kernel writes it into `scratch`'s tensor where one is given: pagedserve/scratch.py).
    """
    if type(meta) is KernelMetadata:
        return cpu_backend.paged_attention(q, k, v, k_cache, v_cache, meta, scale, scratch)
    if type(meta) is TorchMetadata:
        return torch_backend.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    from pagedserve.attention import triton_backend  # only Triton metadata is left; imported by now
    return triton_backend.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
