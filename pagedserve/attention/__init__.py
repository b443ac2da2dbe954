"""Paged attention backends: write new K/V into the block pool by slot, attend through
each request's block table.

The model and the runner call `build_metadata` and `paged_attention` from here; which backend
serves them is decided once per process and device type (`backend_for`):

- `cpu`: the compiled kernel in attention/cpu (reads K/V in place), chosen by default for CPU
  tensors when it builds; where it cannot (no compiler, a build error) one warning says why
  and the torch reference serves instead.
- `torch`: the pure-torch reference (torch_backend), for CUDA tensors, for tests, and as the
  fallback.

PAGEDSERVE_ATTENTION_BACKEND=auto|torch|cpu forces the choice; `cpu` where the kernel cannot
build is an error, not a fallback. The metadata records which backend built it, and
`paged_attention` follows it, so one step never mixes two layouts of metadata.
"""
from __future__ import annotations

import logging
import os
from functools import cache

import numpy as np
import torch

from pagedserve.attention import cpu_backend, torch_backend
from pagedserve.attention.cpu import KernelUnavailable, load_kernel
from pagedserve.attention.cpu_backend import KernelMetadata
from pagedserve.attention.torch_backend import AttentionMetadata as TorchMetadata

logger = logging.getLogger("pagedserve.attention")

BACKEND_ENV = "PAGEDSERVE_ATTENTION_BACKEND"
BACKEND_CHOICES = ("auto", "torch", "cpu")

AttentionMetadata = TorchMetadata | KernelMetadata  # what build_metadata returns, whichever backend


@cache
def backend_for(device_type: str) -> str:
    """'cpu' (the compiled kernel) or 'torch', for tensors on `device_type`; decided once."""
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV}={choice!r}: expected one of {', '.join(BACKEND_CHOICES)}")
    if device_type != "cpu":
        if choice == "cpu":
            raise ValueError(f"{BACKEND_ENV}=cpu runs on CPU tensors only, but the model is on {device_type}")
        return "torch"
    if choice == "torch":
        return "torch"
    try:
        load_kernel()
    except KernelUnavailable as e:
        if choice == "cpu":
            raise RuntimeError(f"{BACKEND_ENV}=cpu, but the CPU attention kernel is unavailable: {e}") from e
        logger.warning("CPU attention kernel unavailable, using the torch reference: %s", e)
        return "torch"
    return "cpu"


def build_metadata(decodes: list[tuple[np.ndarray, int]], prefills: list[tuple[np.ndarray, int, int]],
                   block_size: int, sliding_window: int | None,
                   device: torch.device) -> tuple[AttentionMetadata, np.ndarray]:
    """decodes: (block_ids, position) per request; prefills: (block_ids, start_pos, q_len).

    Returns the chosen backend's metadata and the positions of all tokens in layout order.
    """
    if backend_for(torch.device(device).type) == "cpu":
        return cpu_backend.build_metadata(decodes, prefills, block_size, sliding_window, device)
    return torch_backend.build_metadata(decodes, prefills, block_size, sliding_window, device)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; k_cache/v_cache: [num_slots, KV, D] (one layer).

    Writes k/v into the cache at meta.slot_mapping, returns attention output [T, H, D].
    """
    if type(meta) is KernelMetadata:
        return cpu_backend.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    return torch_backend.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
