"""Paged attention for CUDA tensors as Triton kernels (runs on CPU under TRITON_INTERPRET=1).

Same contract as torch_backend and cpu_backend: a step's tokens are laid out decodes first,
then prefill chunks; `paged_attention` writes each new token's K/V at its slot, then attends.
K and V are read in place from the pool (one layer: [num_slots, kv_heads, head_dim], slot =
block_id * block_size + offset) through each sequence's block table: no gather, no mask tensor.

Invariants the kernels rely on (checked on the host before the first layer of a step runs):
- every slot in slot_mapping is < num_slots, or -1 = a padding row whose K/V is not written
  (CUDA-graph batches are padded that way);
- every sequence's table holds ceil(ctx_len / block_size) valid block ids; entries past that
  are never read, whatever they hold (holes and stale ids are fine);
- a sequence with q_len 0 (padding) attends nothing and stores nothing.

How the work is cut: one program per (query tile, kv head). A tile's rows are BLOCK_Q query
tokens x the GROUP query heads that share the kv head, so GQA reads each K/V tile once for
the whole group. Decodes use BLOCK_Q = 1 (one program per sequence), prefill chunks BLOCK_Q =
PREFILL_TILE_TOKENS. Softmax is online (running max and sum in fp32, exp2 with log2(e) folded
into the scale); the QK and PV products accumulate in fp32 whatever the cache dtype, and fp32
caches multiply in IEEE fp32 (no TF32), so fp32 results match the torch reference closely.
16-bit caches multiply in their dtype (P rounded to it, as FlashAttention does), except bf16
in the interpreter (see dot_in_fp32): CI's interpreter runs never check the bf16 tensor-core path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl

from pagedserve.attention.torch_backend import slots_for

# Query tokens per prefill tile; a tile's rows are this x the query heads per kv head.
PREFILL_TILE_TOKENS = 16
# Keys per inner-loop step (tl.dot needs every dimension >= 16).
KEYS_PER_STEP = 32
MIN_DOT_ROWS = 16
NO_WINDOW = 1 << 30  # a window no context reaches: the kernel then needs no branch
SUPPORTED_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor      # [T] int64 on the device; -1 = padding, not written
    num_decodes: int                # sequences [0, num_decodes) are decodes at rows [0, num_decodes)
    q_start: torch.Tensor           # [S] int32: first row of each sequence in the step's layout
    q_len: torch.Tensor             # [S] int32: its new tokens this step (0 = padding)
    ctx_len: torch.Tensor           # [S] int32: tokens it attends over, the new ones included
    block_tables: torch.Tensor      # [S, W] int32: block ids, row stride W
    prefill_tiles: torch.Tensor     # [N, 2] int32: (sequence, first query token in it) per prefill tile
    num_prefill_tiles: int
    block_size: int
    sliding_window: int             # NO_WINDOW = none
    # (min, max) of the slots and of the block ids the kernels will touch, read on the host.
    slot_range: tuple[int, int] = (0, -1)
    block_range: tuple[int, int] = (0, -1)
    checked_slots: int = field(default=-1, repr=False)

    def check_bounds(self, num_slots: int) -> None:
        """A slot or block id past the pool would be an illegal address on the device: refuse
        it on the host, once per step (every layer's pool has the same size)."""
        if self.checked_slots == num_slots:
            return
        low, high = self.slot_range
        if high >= num_slots or low < -1:
            raise ValueError(f"slot_mapping holds slot {high if high >= num_slots else low} outside the pool of "
                             f"{num_slots} slots")
        num_blocks = num_slots // self.block_size
        low, high = self.block_range
        if high >= num_blocks or low < 0:
            raise ValueError(f"block table holds block {high if high >= num_blocks else low} outside the pool of "
                             f"{num_blocks} blocks")
        self.checked_slots = num_slots


def _tables(block_ids: list[np.ndarray], ctx_len: np.ndarray, block_size: int) -> np.ndarray:
    """[S, W] int32, each row the blocks its context needs, zero-padded."""
    need = -(-ctx_len // block_size)
    width = max(1, int(need.max()) if len(need) else 1)
    table = np.zeros((len(block_ids), width), dtype=np.int32)
    for row, (blocks, n) in enumerate(zip(block_ids, need)):
        n = int(n)
        if len(blocks) < n:
            raise ValueError(f"block table {row} has {len(blocks)} blocks for {int(ctx_len[row])} tokens "
                             f"of {block_size}")
        table[row, :n] = blocks[:n]
    return table


def _prefill_tiles(num_decodes: int, prefill_lens: list[int]) -> np.ndarray:
    tiles = [(num_decodes + j, first) for j, n in enumerate(prefill_lens)
             for first in range(0, n, PREFILL_TILE_TOKENS)]
    return np.array(tiles, dtype=np.int32).reshape(-1, 2)


def build_metadata(decodes: list[tuple[np.ndarray, int]], prefills: list[tuple[np.ndarray, int, int]],
                   block_size: int, sliding_window: int | None,
                   device: torch.device) -> tuple[TritonMetadata, np.ndarray]:
    """decodes: (block_ids, position) per request; prefills: (block_ids, start_pos, q_len).

    Returns the metadata (its int arrays uploaded in one copy) and the positions of all tokens
    in layout order.
    """
    dec_pos = np.fromiter((p for _, p in decodes), dtype=np.int64, count=len(decodes))
    positions = [dec_pos]
    slots = []
    if decodes:
        slots.append(np.fromiter((b[p // block_size] for b, p in decodes), dtype=np.int64, count=len(decodes))
                     * block_size + dec_pos % block_size)
    q_len = [1] * len(decodes) + [n for _, _, n in prefills]
    ctx_len = list(dec_pos + 1) + [start + n for _, start, n in prefills]
    for blocks, start, n in prefills:
        pos = np.arange(start, start + n, dtype=np.int64)
        positions.append(pos)
        slots.append(slots_for(np.asarray(blocks), pos, block_size))
    q_len_arr = np.array(q_len, dtype=np.int32)
    ctx_arr = np.array(ctx_len, dtype=np.int32)
    q_start = (np.cumsum(q_len_arr, dtype=np.int64) - q_len_arr).astype(np.int32)
    tables = _tables([np.asarray(b) for b, _ in decodes] + [np.asarray(b) for b, _, _ in prefills], ctx_arr,
                     block_size)
    tiles = _prefill_tiles(len(decodes), [n for _, _, n in prefills])
    all_pos = np.concatenate(positions)
    slot_np = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
    meta = upload(slot_np, len(decodes), q_start, q_len_arr, ctx_arr, tables, tiles, block_size, sliding_window,
                  device)
    return meta, all_pos


def upload(slot_mapping: np.ndarray, num_decodes: int, q_start: np.ndarray, q_len: np.ndarray,
           ctx_len: np.ndarray, tables: np.ndarray, tiles: np.ndarray, block_size: int,
           sliding_window: int | None, device: torch.device) -> TritonMetadata:
    """The int32 arrays go to the device as one buffer (one copy per step, not five)."""
    num_seqs = len(q_len)
    packed = np.concatenate([q_start, q_len, ctx_len, tiles.ravel(), tables.ravel()]).astype(np.int32)
    on_device = torch.from_numpy(packed).to(device)
    cuts = np.cumsum([num_seqs, num_seqs, num_seqs, tiles.size])
    q_start_t, q_len_t, ctx_t, tiles_t, tables_t = torch.tensor_split(on_device, cuts.tolist())
    used = np.arange(tables.shape[1])[None, :] < -(-ctx_len.astype(np.int64) // block_size)[:, None]
    return TritonMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device), num_decodes=num_decodes,
        q_start=q_start_t, q_len=q_len_t, ctx_len=ctx_t, block_tables=tables_t.view(tables.shape),
        prefill_tiles=tiles_t.view(-1, 2), num_prefill_tiles=len(tiles), block_size=block_size,
        sliding_window=sliding_window or NO_WINDOW,
        slot_range=(int(slot_mapping.min()), int(slot_mapping.max())) if len(slot_mapping) else (0, -1),
        block_range=(int(tables[used].min()), int(tables[used].max())) if used.any() else (0, -1))


# -- kernels ----------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Token t's K and V rows into the pool at slot_mapping[t]; slot -1 = padding, skipped."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK)
    head = i // HEAD_DIM
    d = i % HEAD_DIM
    # slot broadcast to a block first: the interpreter refuses a scalar & block mask
    ok = (i < KV_HEADS * HEAD_DIM) & (slot + i * 0 >= 0)
    k = tl.load(k_ptr + t * stride_kt + head * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + d, mask=ok)
    dst = slot * stride_cs + head * stride_ch + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
                      q_start_ptr, q_len_ptr, ctx_len_ptr, table_ptr, tiles_ptr,
                      stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_table,
                      scale_log2, window,
                      BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                      GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, TILED: tl.constexpr, DOT_FP32: tl.constexpr):
    """One (query tile, kv head): rows m = (query token m // GROUP, head kv_head * GROUP + m % GROUP)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if TILED:
        seq = tl.load(tiles_ptr + 2 * tile)
        first = tl.load(tiles_ptr + 2 * tile + 1)
    else:  # decodes: program i is sequence i, its one token
        seq = tile
        first = 0
    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_len_ptr + seq)
    ctx_len = tl.load(ctx_len_ptr + seq)

    m = tl.arange(0, BLOCK_M)
    q_idx = first + m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = (m < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len - q_len + q_idx                     # each row's position in its sequence
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    q_row = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    # Keys this tile can see: from the first row's window floor to the last row's position.
    last = tl.minimum(first + BLOCK_Q, q_len) - 1
    hi = ctx_len - q_len + last + 1
    lo = tl.maximum(ctx_len - q_len + first - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        block = tl.load(table_row + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        kv_off = slot[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        visible = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet stays at 0
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# TRITON_INTERPRET=1 when triton was imported: the kernels run in numpy on the host (triton_check.interpreted)
INTERPRETED = type(_attention_kernel).__name__ == "InterpretedFunction"


# -- entry points -----------------------------------------------------------------------------
def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache[slot_mapping[t]] = k[t] (v alike) for every t with slot_mapping[t] >= 0."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK=triton.next_power_of_2(kv_heads * head_dim))


def dot_in_fp32(cache_dtype: torch.dtype) -> bool:
    """fp32 caches multiply in IEEE fp32 (TF32 would cost parity with the reference). 16-bit
    caches multiply in their own dtype on tensor cores, except bf16 under the interpreter,
    whose dot misreads bf16 (it holds them as uint16): there the products run in fp32."""
    return cache_dtype == torch.float32 or (cache_dtype == torch.bfloat16 and INTERPRETED)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TritonMetadata,
           scale: float, out: torch.Tensor) -> None:
    """out[t] = attention of q[t] over its sequence's cached keys (already written)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[1]
    common = dict(BLOCK_SIZE=meta.block_size, HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
                  GROUP=group, BLOCK_N=KEYS_PER_STEP, DOT_FP32=dot_in_fp32(k_cache.dtype))
    args = (q, k_cache, v_cache, out, meta.q_start, meta.q_len, meta.ctx_len, meta.block_tables,
            meta.prefill_tiles, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
            k_cache.stride(1), meta.block_tables.stride(0), scale * math.log2(math.e), meta.sliding_window)
    kv_heads = k_cache.shape[1]
    if meta.num_decodes:
        rows = max(MIN_DOT_ROWS, triton.next_power_of_2(group))
        _attention_kernel[(meta.num_decodes, kv_heads)](*args, BLOCK_Q=1, BLOCK_M=rows, TILED=False, **common)
    if meta.num_prefill_tiles:
        rows = max(MIN_DOT_ROWS, triton.next_power_of_2(PREFILL_TILE_TOKENS * group))
        _attention_kernel[(meta.num_prefill_tiles, kv_heads)](*args, BLOCK_Q=rows // group, BLOCK_M=rows,
                                                              TILED=True, **common)


def check_inputs(q: torch.Tensor, k: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if not (isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)):
        raise ValueError("triton attention backend: a quantized KV cache (kv_cache_dtype) is read by the torch "
                         "reference, not these kernels (attention.backend_for_cache)")
    if k_cache.dtype not in SUPPORTED_CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"triton attention backend: cache dtype {k_cache.dtype} / {v_cache.dtype} not supported "
                         f"(expected one of {', '.join(map(str, SUPPORTED_CACHE_DTYPES))})")
    if k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("triton attention backend: k_cache and v_cache must be [num_slots, KV, D] with D contiguous")
    if q.shape[1] % k_cache.shape[1] or k.shape[1:] != k_cache.shape[1:]:
        raise ValueError(f"triton attention backend: q {tuple(q.shape)}, k {tuple(k.shape)} do not fit the cache "
                         f"{tuple(k_cache.shape)}")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: TritonMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; k_cache/v_cache: [num_slots, KV, D] (one layer).

    Writes k/v into the cache at meta.slot_mapping, returns attention output [T, H, D] in q's dtype.
    """
    check_inputs(q, k, k_cache, v_cache)
    meta.check_bounds(k_cache.shape[0])
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    q = _last_dim_contiguous(q)
    out = torch.empty_like(q)
    attend(q, k_cache, v_cache, meta, scale, out)
    return out
