"""Paged attention on CPU tensors through the compiled kernel (pagedserve/attention/cpu).

Same contract as torch_backend: a step's tokens are laid out decodes first, then prefill
chunks; `paged_attention` writes each token's K/V at its slot, then attends. The difference is
where K/V are read: the kernel walks each sequence's block table in the pool itself, so no
layer gathers blocks into a padded buffer and no step builds a mask.

Who attends what (measured: `benchmarks/attention_kernel.py --prefill`): decodes and short
prefill chunks go to the kernel as one plan. Longer fresh chunks (no cached key, no window: a
burst's prompts) go to the kernel's tiled causal path (ps_fresh_prefill), which reads the
chunk's own K/V rows and computes its scores as register GEMMs (SDPA took 2.4-4.2x its time per
layer, 48 to 2,048 tokens a chunk: benchmarks/README.md). Longer chunks that see cached keys (a
prefix hit, a later piece of a chunked prefill) go to the same tiled path reading keys [0, start +
q_len) from the pool through their block tables (ps_cached_prefill; the step's K/V are written
there first). Longer chunks under a window that hides some key go to torch's SDPA through the
reference path (its own blocks gathered, a mask), as do tiled-path chunks over a quantized cache
or with more than 32 query heads per kv head.
The plan is built once per step and shared by every layer.

A quantized cache (kv_quant.QuantizedKV: fp8 / int8 with scales) is written by kv_quant.store and
read by the kernel, which decodes each byte and applies its scale as it loads a tile; q and the
output are then fp32.
"""
from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field
from functools import cache
from typing import Sequence

import numpy as np
import torch

from pagedserve.attention.cpu import DTYPE_CODES, AttentionPlan, load_kernel
from pagedserve.attention.kv_quant import KVCacheLayer, QuantizedKV, store
from pagedserve.attention.torch_backend import PrefillChunk, attend_prefill_chunk, prefill_chunk, slots_for
from pagedserve.native import ConvertedArgs
from pagedserve.scratch import ScratchOutput

# Chunks the plan's kernel attends. Longer fresh chunks go to the tiled causal path (at 8 tokens it
# beat the plan's kernel in 4 of 4 cases, 4/2 and 16/4 heads x 64, fp32 and bf16, one thread on the
# 2-core AVX-512 EPYC; at 4 it lost 2, tied 1: benchmarks/README.md, 2026-12-04 second sitting).
# Longer unwindowed chunks after cached keys go to the tiled path over the pool (ps_cached_prefill):
# `benchmarks/fresh_prefill.py --cached-routing`, one thread, whole paged_attention calls on 8 chunks
# of n after c = 64 / 512 / 2048 cached tokens, 16/4 and 4/2 heads x 64, fp32 and bf16 (12 cases per
# n; 2-core host, 2026-12-04): plan/tiled time at n = 4: 0.57-1.30 (tiled won 6 of 12), n = 8:
# 0.94-1.62 (won 11 of 12, lost 19M fp32 after 2048), n = 12: 1.15-1.93 (12 of 12). At n = 1 the
# tiled path took 2-4x the plan's (it widens every cached key once per kv head for few queries).
KERNEL_MAX_FRESH_CHUNK = 7
KERNEL_MAX_CACHED_CHUNK = 7
# The tiled path takes at most FRESH_MAX_GROUP query heads per kv head (one tile's 32 lanes).
FRESH_MAX_GROUP = 32


@dataclass
class KernelMetadata:
    slot_mapping: torch.Tensor          # [T] int64: where each new token's K/V is written
    num_decodes: int
    plan: AttentionPlan                 # rows the kernel attends (num_seqs 0 = none this step)
    sdpa_chunks: list[PrefillChunk]     # chunks SDPA attends (torch_backend.attend_prefill_chunk)
    block_size: int
    # Fresh causal chunks for ps_fresh_prefill (SDPA's if the kernel cannot take them), and their
    # (num_chunks, q_start, q_len) as ctypes arguments made once per step.
    fresh_chunks: list[PrefillChunk] = field(default_factory=list)
    fresh_args: tuple = field(default=(), repr=False)
    fresh_rows: np.ndarray | None = field(default=None, repr=False)  # [2, n] int32 behind fresh_args
    # Longer chunks after cached keys for ps_cached_prefill, as a plan of their own (its tables
    # read from the pool as the plan kernel reads them), and (blocks, start, q_len, row) per chunk
    # to make their SDPA inputs if the kernel cannot take them (a quantized cache, a wide group).
    cached_plan: AttentionPlan | None = None
    cached_spans: list[tuple] = field(default_factory=list, repr=False)
    cached_arrays: tuple[np.ndarray, ...] = field(default=(), repr=False)
    cached_plan_ref: object = field(default=None, repr=False)
    cached_sdpa: list[PrefillChunk] | None = field(default=None, repr=False)  # made on first need
    # The arrays behind plan's pointers: they must live as long as the plan.
    plan_arrays: tuple[np.ndarray, ...] = field(default=(), repr=False)
    plan_ref: object = field(default=None, repr=False)  # ctypes.byref(plan), made once per step
    checked_slots: int = field(default=-1, repr=False)  # pool size the slots and tables were checked against
    slot_mapping_arg: object = field(default=None, repr=False)  # c_void_p(slot_mapping.data_ptr()), once per step
    checked_pools: dict = field(default_factory=dict, repr=False)  # id(k_cache) -> (k_cache, v_cache, token stride)

    def __post_init__(self) -> None:
        self.plan_ref = ctypes.byref(self.plan)
        self.slot_mapping_arg = ctypes.c_void_p(self.slot_mapping.data_ptr())

    def contiguous_pool_stride(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
        """k_cache's token stride, after refusing a pool that is not contiguous [num_slots, KV, D]
        and checking the step's slots and tables against it (`check_bounds`); a layer's pool
        pair is checked once per step (its views are made once per pool: LlamaForCausalLM)."""
        checked = self.checked_pools.get(id(k_cache))
        if checked is not None and checked[0] is k_cache and checked[1] is v_cache:
            return checked[2]
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("cpu attention backend: k_cache and v_cache must be contiguous [num_slots, KV, D]")
        self.check_bounds(k_cache.shape[0])
        token_stride = k_cache.stride(0)
        self.checked_pools[id(k_cache)] = (k_cache, v_cache, token_stride)
        return token_stride

    def cached_sdpa_chunks(self) -> list[PrefillChunk]:
        """The cached chunks' SDPA inputs (context blocks and a mask), made on first need."""
        if self.cached_sdpa is None:
            self.cached_sdpa = [prefill_chunk(blocks, start, n, row, self.block_size, None, torch.device("cpu"))
                                for blocks, start, n, row in self.cached_spans]
        return self.cached_sdpa

    def check_bounds(self, num_slots: int) -> None:
        """The kernel writes and reads raw memory: a slot or block id outside the pool must be
        an error here, not a stray write. Checked once per step (every layer's pool is alike)."""
        if self.checked_slots == num_slots:
            return
        slots = self.slot_mapping.numpy()
        if len(slots) and (slots.max() >= num_slots or slots.min() < 0):
            raise ValueError(f"slot_mapping holds slot {int(slots.max() if slots.max() >= num_slots else slots.min())} "
                             f"outside the pool of {num_slots} slots")
        for arrays in (self.plan_arrays, self.cached_arrays):
            if not arrays:
                continue
            table = arrays[3]
            num_blocks = num_slots // self.block_size
            if table.max() >= num_blocks or table.min() < 0:
                bad = int(table.max() if table.max() >= num_blocks else table.min())
                raise ValueError(f"block table holds block {bad} outside the pool of {num_blocks} blocks")
        self.checked_slots = num_slots


def make_plan(q_start: Sequence[int], q_len: Sequence[int], ctx_len: Sequence[int], tables: Sequence[Sequence[int]],
              block_size: int, sliding_window: int | None) -> tuple[AttentionPlan, tuple[np.ndarray, ...]]:
    """tables[i] holds at least ceil(ctx_len[i] / block_size) block ids of sequence i (a list
    or an array). The padded int32 table is made from the ids in one pass, not a numpy call
    per row (which was most of a decode step's metadata at 256 sequences)."""
    needed = [-(-int(c) // block_size) for c in ctx_len]
    width = max(1, max(needed))
    held = list(map(len, tables))
    if held == needed:  # the usual case: each table is exactly its context's blocks
        flat = itertools.chain.from_iterable(tables)
    else:
        for row, (num_held, n) in enumerate(zip(held, needed)):
            if num_held < n:
                raise ValueError(f"block table {row} has {num_held} blocks for {int(ctx_len[row])} tokens of "
                                 f"{block_size}")
        flat = itertools.chain.from_iterable(t[:n] for t, n in zip(tables, needed))
    total = sum(needed)
    if total == width * len(needed):  # no padding (one sequence, or all of one length)
        table = np.fromiter(flat, dtype=np.int32, count=total).reshape(len(needed), width)
    else:
        table = np.zeros((len(needed), width), dtype=np.int32)
        table[np.arange(width)[None, :] < np.array(needed)[:, None]] = np.fromiter(flat, dtype=np.int32, count=total)
    arrays = tuple(np.array(a, dtype=np.int32) for a in (q_start, q_len, ctx_len)) + (table,)
    plan = AttentionPlan(len(needed), *(a.ctypes.data for a in arrays), width, block_size, sliding_window or 0)
    return plan, arrays


def build_metadata(decodes: list[tuple[Sequence[int], int]], prefills: list[tuple[Sequence[int], int, int]],
                   block_size: int, sliding_window: int | None,
                   device: torch.device) -> tuple[KernelMetadata, np.ndarray]:
    """decodes: (block_ids, position) per request; prefills: (block_ids, start_pos, q_len);
    block ids as a list or an array.

    Returns the metadata and the positions of all tokens in layout order.
    """
    num_decodes = len(decodes)
    tables: list[Sequence[int]] = [blocks for blocks, _ in decodes]
    dec_pos = [p for _, p in decodes]
    positions: list[np.ndarray] = [np.array(dec_pos, dtype=np.int64)]
    # each decode's slot: its position's offset in the block holding it
    slots: list[np.ndarray] = [np.array([b[p // block_size] * block_size + p % block_size for b, p in decodes],
                                        dtype=np.int64)] if decodes else []
    q_start, q_len, ctx_len = list(range(num_decodes)), [1] * num_decodes, [p + 1 for p in dec_pos]
    sdpa_chunks: list[PrefillChunk] = []
    fresh_chunks: list[PrefillChunk] = []
    cached_spans: list[tuple] = []
    cached_plan_rows: tuple[list, list, list, list] = ([], [], [], [])  # q_start, q_len, ctx_len, tables
    row = num_decodes
    for blocks, start, n in prefills:
        blocks = np.asarray(blocks, dtype=np.int64)
        pos = np.arange(start, start + n, dtype=np.int64)
        positions.append(pos)
        slots.append(slots_for(blocks, pos, block_size))
        unwindowed = not (sliding_window and start + n > sliding_window)  # the window hides no key
        fresh = start == 0 and unwindowed
        if fresh and n > KERNEL_MAX_FRESH_CHUNK:
            fresh_chunks.append(PrefillChunk(row, n, 0, None, None))
        elif start > 0 and unwindowed and n > KERNEL_MAX_CACHED_CHUNK:
            cached_spans.append((blocks, start, n, row))
            for lst, x in zip(cached_plan_rows, (row, n, start + n, blocks)):
                lst.append(x)
        elif n > (KERNEL_MAX_FRESH_CHUNK if fresh else KERNEL_MAX_CACHED_CHUNK):
            sdpa_chunks.append(prefill_chunk(blocks, start, n, row, block_size, sliding_window, device))
        else:
            q_start.append(row)
            q_len.append(n)
            ctx_len.append(start + n)
            tables.append(blocks)
        row += n
    plan, arrays = AttentionPlan(0, 0, 0, 0, 0, 0, block_size, 0), ()
    if tables:
        plan, arrays = make_plan(q_start, q_len, ctx_len, tables, block_size, sliding_window)
    all_pos = np.concatenate(positions) if len(positions) > 1 else positions[0]
    slot_mapping = torch.from_numpy(np.concatenate(slots) if len(slots) > 1 else
                                    slots[0] if slots else np.zeros(0, dtype=np.int64))
    meta = KernelMetadata(slot_mapping, num_decodes, plan, sdpa_chunks, block_size, fresh_chunks, plan_arrays=arrays)
    if cached_spans:
        meta.cached_plan, meta.cached_arrays = make_plan(*cached_plan_rows, block_size, None)
        meta.cached_plan_ref = ctypes.byref(meta.cached_plan)
        meta.cached_spans = cached_spans
    if fresh_chunks:
        fresh_rows = np.array([(c.q_start, c.q_len) for c in fresh_chunks], dtype=np.int32).T.copy()
        meta.fresh_rows = fresh_rows
        meta.fresh_args = (ctypes.c_int64(len(fresh_chunks)), ctypes.c_void_p(fresh_rows[0].ctypes.data),
                           ctypes.c_void_p(fresh_rows[1].ctypes.data))
    return meta, all_pos


TORCH_DTYPE_CODES = {getattr(torch, name): code for name, code in DTYPE_CODES.items()}


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] with each token's heads contiguous (a row stride is fine)."""
    stride = x.stride()
    if stride[2] != 1 or stride[1] != x.shape[2]:
        return x.contiguous()
    return x


def _row_stride(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x, or a copy of it, with each token's heads contiguous; its row stride): `_token_rows`
    reading the strides once (`stride()` is an argument-parsed torch call)."""
    stride = x.stride()
    if stride[2] != 1 or stride[1] != x.shape[2]:
        x = x.contiguous()
        return x, x.shape[1] * x.shape[2]
    return x, stride[0]


@cache
def _attention_layer_call() -> ConvertedArgs:
    """ps_attention_layer, the step's plan and slot mapping passed as made (ctypes objects made
    once per step) and the rest converted once per distinct tuple of values (native.ConvertedArgs:
    each layer's shapes and addresses are the same every step)."""
    return ConvertedArgs(load_kernel().ps_attention_layer, raw=2)


@cache
def _fresh_prefill_call() -> ConvertedArgs:
    """ps_fresh_prefill, the step's chunk arrays passed as made (fresh_args), the rest as
    _attention_layer_call converts them."""
    return ConvertedArgs(load_kernel().ps_fresh_prefill, raw=3)


@cache
def _cached_prefill_call() -> ConvertedArgs:
    """ps_cached_prefill, the step's cached-chunk plan passed as made (cached_plan_ref), the rest
    as _attention_layer_call converts them."""
    return ConvertedArgs(load_kernel().ps_cached_prefill, raw=1)


def _check(rc: int, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    if rc != 0:
        why = {-1: "bad shape", -2: f"{k_cache.dtype} not supported by this build of the kernel"}.get(rc, f"error {rc}")
        raise RuntimeError(f"CPU attention kernel: {why} (q {tuple(q.shape)} {q.dtype}, cache {tuple(k_cache.shape)} "
                           f"{k_cache.dtype}); PAGEDSERVE_ATTENTION_BACKEND=torch avoids the kernel")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache[slot_mapping[t]] = k[t], v alike: one row copy per token, no dispatch per element.
    (paged_attention does this and the attention in one call; this is for measuring the write.)"""
    k, v = _token_rows(k.to(k_cache.dtype)), _token_rows(v.to(v_cache.dtype))
    size = k.element_size()
    load_kernel().ps_write_kv(k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size,
                              k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0) * size,
                              slot_mapping.data_ptr(), k.shape[0], k.shape[1] * k.shape[2] * size,
                              torch.get_num_threads())


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: KVCacheLayer, v_cache: KVCacheLayer, meta: KernelMetadata,
                    scale: float, scratch: ScratchOutput | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; k_cache/v_cache: [num_slots, KV, D] (one layer, contiguous).

    Writes k/v into the cache at meta.slot_mapping, returns attention output [T, H, D]. The
    write and the kernel's rows are one foreign call per layer (the call itself costs microseconds).
    """
    if isinstance(k_cache, QuantizedKV):
        return _paged_attention_quantized(q, k, v, k_cache, v_cache, meta, scale)
    token_stride = meta.contiguous_pool_stride(k_cache, v_cache)
    compute_dtype = q.dtype
    cache_dtype = k_cache.dtype
    if q.dtype != cache_dtype or k.dtype != cache_dtype:  # the kernel reads all in the cache's dtype
        q, k, v = q.to(cache_dtype), k.to(cache_dtype), v.to(cache_dtype)
    (q, q_stride), (k, k_stride), (v, v_stride) = _row_stride(q), _row_stride(k), _row_stride(v)
    num_tokens, num_heads, head_dim = q.shape
    shape = (num_tokens, num_heads, head_dim)
    out = torch.empty(*shape, dtype=cache_dtype) if scratch is None else scratch.get(shape, cache_dtype)
    rc = _attention_layer_call().call_raw(
        (meta.plan_ref, meta.slot_mapping_arg), num_tokens, k.data_ptr(), k_stride, v.data_ptr(), v_stride,
        q.data_ptr(), q_stride, out.data_ptr(), num_heads * head_dim, k_cache.data_ptr(), v_cache.data_ptr(),
        meta.block_size * token_stride, head_dim, token_stride, TORCH_DTYPE_CODES[cache_dtype], num_heads,
        k.shape[1], head_dim, scale, torch.get_num_threads())
    _check(rc, q, k_cache)
    sdpa_chunks = meta.sdpa_chunks
    tiled = num_heads // k.shape[1] <= FRESH_MAX_GROUP  # the tiled paths take this group width
    if meta.fresh_chunks:
        if tiled:
            rc = _fresh_prefill_call().call_raw(
                meta.fresh_args, q.data_ptr(), q_stride, k.data_ptr(), k_stride, v.data_ptr(), v_stride, out.data_ptr(),
                num_heads * head_dim, TORCH_DTYPE_CODES[cache_dtype], num_heads, k.shape[1], head_dim, scale,
                torch.get_num_threads())
            _check(rc, q, k_cache)
        else:
            sdpa_chunks = sdpa_chunks + meta.fresh_chunks
    if meta.cached_spans:  # the chunks' K/V were written to the pool by ps_attention_layer above
        if tiled:
            rc = _cached_prefill_call().call_raw(
                (meta.cached_plan_ref,), q.data_ptr(), q_stride, k_cache.data_ptr(), v_cache.data_ptr(),
                meta.block_size * token_stride, head_dim, token_stride, out.data_ptr(), num_heads * head_dim,
                TORCH_DTYPE_CODES[cache_dtype], num_heads, k.shape[1], head_dim, scale, torch.get_num_threads())
            _check(rc, q, k_cache)
        else:
            sdpa_chunks = sdpa_chunks + meta.cached_sdpa_chunks()
    for c in sdpa_chunks:
        out[c.q_start:c.q_start + c.q_len] = attend_prefill_chunk(q, k, v, k_cache, v_cache, c, meta.block_size, scale)
    return out if compute_dtype == cache_dtype else out.to(compute_dtype)


def _paged_attention_quantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: QuantizedKV,
                               v_cache: QuantizedKV, meta: KernelMetadata, scale: float) -> torch.Tensor:
    """paged_attention over a quantized cache: k/v quantized into it (torch), the kernel's rows
    read with fp32 q, SDPA chunks through the reference's dequantizing gather."""
    values = k_cache.values
    if not (values.is_contiguous() and v_cache.values.is_contiguous()):
        raise ValueError("cpu attention backend: k_cache and v_cache must be contiguous [num_slots, KV, D]")
    meta.check_bounds(values.shape[0])
    store(k_cache, meta.slot_mapping, k)
    store(v_cache, meta.slot_mapping, v)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float32)
    if meta.plan.num_seqs:
        qf = _token_rows(q.float())
        per_token = k_cache.scales is not None
        token_stride = values.stride(0)
        rc = load_kernel().ps_paged_attention(
            meta.plan_ref, qf.data_ptr(), qf.stride(0), DTYPE_CODES["float32"], values.data_ptr(),
            v_cache.values.data_ptr(), meta.block_size * token_stride, head_dim, token_stride,
            k_cache.fmt.kernel_code, out.data_ptr(), num_heads * head_dim, num_heads, values.shape[1], head_dim,
            scale, k_cache.scales.data_ptr() if per_token else None,
            v_cache.scales.data_ptr() if per_token else None, k_cache.scales.stride(0) if per_token else 0,
            k_cache.scale, v_cache.scale, torch.get_num_threads())
        _check(rc, qf, values)
    for c in meta.sdpa_chunks + meta.fresh_chunks + meta.cached_sdpa_chunks():  # the tiled paths read plain K/V
        out[c.q_start:c.q_start + c.q_len] = attend_prefill_chunk(q, k, v, k_cache, v_cache, c, meta.block_size, scale)
    return out if q.dtype == torch.float32 else out.to(q.dtype)
