"""Paged multi-head latent attention (DeepSeek-V2/V3) in plain torch, over a latent cache.

The cache of one layer is [num_slots, 1, kv_lora_rank + qk_rope_head_dim]: per token the
normed KV latent c and the rotated rope key k_r, shared by every head (the pool is the
runner's usual [layers, K, slots, heads, dim] tensor with K = heads = 1). Per head h the
checkpoint's kv_b_proj holds W_k[h] [nope, R] and W_v[h] [v, R]: k_nope = W_k c, v = W_v c.

Two ways to attend, with the same result up to float rounding:

- absorbed (`attend_absorbed`): q_nope . (W_k c) = (W_k^T q_nope) . c, so each query is
  moved into latent space once ([H, R + rope] wide) and attends to the cached entries as
  they are: multi-query attention with one shared K (the whole entry) and V (its latent
  part); the output is taken out of latent space through W_v. Reads R + rope values per
  cached token, whatever the head count: what makes MLA decode cheap.
- expanded (`attend_expanded`): the cached latents are expanded into per-head keys and
  values through kv_b_proj (a GEMM over the whole context per step), then ordinary
  attention. Fewer FLOPs when many queries share a context (a long prefill chunk): the
  expansion is paid once per context token instead of the absorbed path's
  heads x (R + rope)-wide scores per query-key pair.

Which the engine uses: decodes are absorbed; prompt chunks are expanded by default
(`PAGEDSERVE_MLA_PREFILL=absorb|expand`). Why: a decode is one query per request against
its whole context, so expanding would multiply every cached latent by kv_b_proj each step
(38x slower than absorbed on a 16 x 1024-token decode batch); a chunk of L queries shares
its context, and there expanding once beats scoring every query-key pair H x (R + rope)
wide (absorbed prefill was 1.3-2.6x slower). benchmarks/mla_attention.py prints both
tables (CPU, one layer of DeepSeek-V3's shapes on a rank with 16 heads). vLLM makes the
same split on GPU for the same reason. Metadata is the torch
reference backend's (attention/torch_backend.py): the same slot mapping, block tables and
masks as GQA attention.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from pagedserve.attention.torch_backend import AttentionMetadata, PrefillChunk, gather_blocks

PREFILL_MODE_ENV = "PAGEDSERVE_MLA_PREFILL"
PREFILL_MODES = ("absorb", "expand")


def prefill_mode() -> str:
    mode = os.environ.get(PREFILL_MODE_ENV, "expand").strip().lower() or "expand"
    if mode not in PREFILL_MODES:
        raise ValueError(f"{PREFILL_MODE_ENV}={mode!r}: expected one of {', '.join(PREFILL_MODES)}")
    return mode


def write_latent(cache: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, meta: AttentionMetadata) -> None:
    """cache [slots, 1, R + rope] <- [latent | k_rope] of the step's tokens at their slots."""
    cache.index_copy_(0, meta.slot_mapping, torch.cat([latent, k_rope], dim=-1).unsqueeze(1))


def absorb_query(q_nope: torch.Tensor, q_rope: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
    """[T, H, nope] x W_k [H, nope, R] -> [T, H, R + rope]: the queries in latent space."""
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_k)
    return torch.cat([q_latent, q_rope], dim=-1)


def attend_absorbed(q_abs: torch.Tensor, entries: torch.Tensor, kv_lora_rank: int, scale: float,
                    mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """q_abs [B, H, L, R + rope]; entries [B, 1, C, R + rope] -> latent output [B, H, L, R].

    Every head reads the same K (the whole entry) and V (its latent part), so the H heads
    are folded into H x L query rows of a single head: SDPA then runs plain one-head
    attention. (Left as H heads over one broadcast K, SDPA's CPU path was ~100x slower on
    a decode batch.) `mask`: a decode batch's [B, 1, 1, C] (broadcasts over the rows) or a
    chunk's [L, C] (the same for every head, so repeated H times); None with `causal`:
    the chunk is its whole context."""
    b, h, l, w = q_abs.shape
    rows = q_abs.reshape(b, 1, h * l, w)
    ctx = entries.shape[2]
    if mask is None and causal:
        mask = torch.ones(l, ctx, dtype=torch.bool, device=q_abs.device).tril(ctx - l)
    if mask is not None and mask.dim() == 2:
        mask = mask.repeat(h, 1)
    out = F.scaled_dot_product_attention(rows, entries, entries[..., :kv_lora_rank], attn_mask=mask, scale=scale)
    return out.view(b, h, l, kv_lora_rank)


def attend_expanded(q_nope: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor, w_kv: torch.Tensor,
                    kv_lora_rank: int, nope: int, scale: float, mask: torch.Tensor | None,
                    causal: bool) -> torch.Tensor:
    """q_nope [L, H, nope], q_rope [L, H, rope]; entries [C, R + rope]; w_kv = kv_b_proj's
    weight [H * (nope + v), R] -> output [L, H, v]."""
    heads = q_nope.shape[1]
    latent, k_rope = entries[:, :kv_lora_rank], entries[:, kv_lora_rank:]
    kv = F.linear(latent, w_kv).view(latent.shape[0], heads, -1)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, heads, -1)], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), attn_mask=mask,
                                       is_causal=causal and mask is None, scale=scale)
    return o.squeeze(0).transpose(0, 1)


def _chunk_entries(cache: torch.Tensor, new_entries: torch.Tensor, c: PrefillChunk, block_size: int) -> torch.Tensor:
    """[C, R + rope]: the chunk's context (the cached prefix, then the chunk itself)."""
    if c.ctx_blocks is None:
        return new_entries[c.q_start:c.q_start + c.q_len]
    return gather_blocks(cache, c.ctx_blocks, block_size)[:c.start_pos + c.q_len, 0]


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                  cache: torch.Tensor, w_kv: torch.Tensor, nope: int, meta: AttentionMetadata,
                  scale: float, mode: str | None = None) -> torch.Tensor:
    """One layer of MLA over the paged latent cache. q_nope [T, H, nope], q_rope [T, H, rope]
    (rotated), latent [T, R] (normed), k_rope [T, rope] (rotated); w_kv = kv_b_proj.weight
    [H * (nope + v), R]. Writes the step's entries into `cache` at meta.slot_mapping and
    returns the attention output [T, H, v] (before o_proj)."""
    num_tokens, heads = q_nope.shape[:2]
    rank = latent.shape[-1]
    w = w_kv.view(heads, -1, rank)
    w_k, w_v = w[:, :nope], w[:, nope:]                        # [H, nope, R], [H, v, R]
    write_latent(cache, latent, k_rope, meta)
    new_entries = cache.new_empty(0) if not meta.prefills else torch.cat([latent, k_rope], dim=-1)
    out = q_nope.new_empty(num_tokens, heads, w_v.shape[1])
    mode = mode or prefill_mode()
    d = meta.num_decodes
    if d:
        q_abs = absorb_query(q_nope[:d], q_rope[:d], w_k).unsqueeze(2)           # [D, H, 1, W]
        entries = gather_blocks(cache, meta.decode_blocks, meta.block_size).transpose(1, 2)  # [D, 1, C, W]
        o_latent = attend_absorbed(q_abs, entries, rank, scale, meta.decode_mask, causal=False)
        out[:d] = torch.einsum("dhr,hvr->dhv", o_latent.squeeze(2), w_v)
    for c in meta.prefills:
        rows = slice(c.q_start, c.q_start + c.q_len)
        entries = _chunk_entries(cache, new_entries, c, meta.block_size)
        if mode == "expand":
            out[rows] = attend_expanded(q_nope[rows], q_rope[rows], entries, w_kv, rank, nope, scale, c.mask,
                                        causal=True)
            continue
        q_abs = absorb_query(q_nope[rows], q_rope[rows], w_k).transpose(0, 1).unsqueeze(0)  # [1, H, L, W]
        o_latent = attend_absorbed(q_abs, entries[None, None], rank, scale, c.mask, causal=True)
        out[rows] = torch.einsum("hlr,hvr->lhv", o_latent.squeeze(0), w_v)
    return out
