"""Reference paged attention in plain torch (CPU, and CUDA tensors too).

A step's tokens are laid out decodes first (one query token each, batched into one
SDPA call over gathered, padded contexts), then prefill chunks (one SDPA call each,
attending to any already-cached prefix plus the chunk itself, causally).
The gather indices and masks are built once per step and shared by every layer.

The caches are plain tensors [num_slots, kv_heads, head_dim] or, with a quantized
`kv_cache_dtype`, `kv_quant.QuantizedKV` views: K/V are quantized as they are written and
dequantized as they are gathered (kv_quant.store / read_blocks / as_stored).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.attention.kv_quant import KVCacheLayer, as_stored, read_blocks, store


@dataclass
class PrefillChunk:
    q_start: int            # first row of this chunk in the step's token layout
    q_len: int
    start_pos: int          # tokens already in the cache before this chunk
    ctx_blocks: torch.Tensor | None  # [n] blocks holding the context; None = use the chunk's own K/V
    mask: torch.Tensor | None       # [q_len, ctx_len] bool, True = attend; None = plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] where each new token's K/V is written
    num_decodes: int
    decode_blocks: torch.Tensor | None  # [D, n] each decode's block table, padded with block 0
    decode_mask: torch.Tensor | None    # [D, 1, 1, n * block_size] bool, True = a real context token
    prefills: list[PrefillChunk]
    block_size: int = 16


def slots_for(block_ids: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    return block_ids[positions // block_size] * block_size + positions % block_size


def window_floor(query_pos: np.ndarray, sliding_window: int | None) -> np.ndarray:
    """Smallest key position each query may see (0 without a sliding window)."""
    if not sliding_window:
        return np.zeros_like(query_pos)
    return np.maximum(query_pos - sliding_window + 1, 0)


def prefill_chunk(blocks: np.ndarray, start: int, q_len: int, row: int, block_size: int,
                  sliding_window: int | None, device: torch.device) -> PrefillChunk:
    """The chunk's SDPA inputs: its context blocks when it sees cached keys, and a mask
    when that or a window makes plain causal attention over its own K/V wrong."""
    pos = np.arange(start, start + q_len, dtype=np.int64)
    ctx_len = start + q_len
    floor = window_floor(pos, sliding_window)
    ctx_blocks = mask = None
    if start > 0:
        ctx_blocks = torch.from_numpy(np.ascontiguousarray(blocks[: -(-ctx_len // block_size)])).to(device)
    if start > 0 or floor.max() > 0:
        key_pos = np.arange(ctx_len, dtype=np.int64)
        m = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] >= floor[:, None])
        mask = torch.from_numpy(m).to(device)
    return PrefillChunk(row, q_len, start, ctx_blocks, mask)


def build_metadata(decodes: list[tuple[np.ndarray, int]], prefills: list[tuple[np.ndarray, int, int]],
                   block_size: int, sliding_window: int | None, device: torch.device) -> tuple[AttentionMetadata, np.ndarray]:
    """decodes: (block_ids, position) per request; prefills: (block_ids, start_pos, q_len);
    block ids as a list or an array.

    Returns the metadata and the positions of all tokens in layout order.
    """
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    decode_blocks = decode_mask = None
    if decodes:
        pos = np.array([p for _, p in decodes], dtype=np.int64)
        ctx = pos + 1
        max_ctx = int(ctx.max())
        max_blocks = -(-max_ctx // block_size)
        table = np.zeros((len(decodes), max_blocks), dtype=np.int64)
        for row, (blocks, _) in enumerate(decodes):
            n = min(len(blocks), max_blocks)
            table[row, :n] = blocks[:n]
        key_pos = np.arange(max_blocks * block_size, dtype=np.int64)
        mask = (key_pos[None, :] < ctx[:, None]) & (key_pos[None, :] >= window_floor(pos, sliding_window)[:, None])
        decode_blocks = torch.from_numpy(table).to(device)
        decode_mask = torch.from_numpy(mask).to(device)[:, None, None, :]
        positions.append(pos)
        slots.append(table[np.arange(len(decodes)), pos // block_size] * block_size + pos % block_size)
    chunks: list[PrefillChunk] = []
    row = len(decodes)
    for blocks, start, q_len in prefills:
        blocks = np.asarray(blocks, dtype=np.int64)  # the runner passes its lists
        pos = np.arange(start, start + q_len, dtype=np.int64)
        positions.append(pos)
        slots.append(slots_for(blocks, pos, block_size))
        chunks.append(prefill_chunk(blocks, start, q_len, row, block_size, sliding_window, device))
        row += q_len
    all_pos = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
    slot_mapping = torch.from_numpy(np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)).to(device)
    return AttentionMetadata(slot_mapping, len(decodes), decode_blocks, decode_mask, chunks, block_size), all_pos


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [slots, KV, D] -> [*blocks.shape[:-1], n * block_size, KV, D], whole blocks at a
    time (one row copy per block instead of one per token)."""
    slots, kv, d = cache.shape
    rows = cache.view(slots // block_size, block_size * kv * d).index_select(0, blocks.reshape(-1))
    return rows.view(*blocks.shape[:-1], blocks.shape[-1] * block_size, kv, d)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: KVCacheLayer, v_cache: KVCacheLayer, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; k_cache/v_cache: [num_slots, KV, D] (one layer).

    Writes k/v into the cache at meta.slot_mapping, returns attention output [T, H, D].
    """
    store(k_cache, meta.slot_mapping, k)
    store(v_cache, meta.slot_mapping, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    d = meta.num_decodes
    if d:
        kd = read_blocks(k_cache, meta.decode_blocks, meta.block_size, q.dtype).transpose(1, 2)  # [D, KV, C, Dh]
        vd = read_blocks(v_cache, meta.decode_blocks, meta.block_size, q.dtype).transpose(1, 2)
        qd = q[:d].unsqueeze(2)                           # [D, H, 1, Dh]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa)
        out[:d] = o.squeeze(2)
    for c in meta.prefills:
        out[c.q_start:c.q_start + c.q_len] = attend_prefill_chunk(q, k, v, k_cache, v_cache, c, meta.block_size, scale)
    return out


def attend_prefill_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: KVCacheLayer,
                         v_cache: KVCacheLayer, c: PrefillChunk, block_size: int, scale: float) -> torch.Tensor:
    """Attention output [q_len, H, D] of one chunk (its K/V already written to the cache)."""
    rows = slice(c.q_start, c.q_start + c.q_len)
    if c.ctx_blocks is None:  # the chunk's own K/V, as the cache holds them
        kc, vc = as_stored(k_cache, k[rows]), as_stored(v_cache, v[rows])
    else:
        ctx_len = c.start_pos + c.q_len
        kc = read_blocks(k_cache, c.ctx_blocks, block_size, q.dtype)[:ctx_len]
        vc = read_blocks(v_cache, c.ctx_blocks, block_size, q.dtype)[:ctx_len]
    qc = q[rows].transpose(0, 1).unsqueeze(0)   # [1, H, L, Dh]
    kc = kc.transpose(0, 1).unsqueeze(0)        # [1, KV, C, Dh]
    vc = vc.transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != k.shape[1]
    if c.mask is None:
        o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, scale=scale, enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)
