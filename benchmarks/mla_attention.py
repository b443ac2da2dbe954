"""MLA attention on CPU: the absorbed path vs the expanded path (attention/mla.py), side by side.

    OMP_NUM_THREADS=1 python benchmarks/mla_attention.py [--heads 16] [--repeat 5]

One layer of DeepSeek-V3's attention shapes on one TP rank (128 heads / TP; kv_lora_rank
512, rope 64, nope 128, v 128) over the paged latent cache, for a decode batch and for
prompt chunks with and without a cached prefix. Prints seconds per call for each path
and the ratio expand / absorb (> 1: absorbing is faster). Both paths give the same
output (checked here to a tolerance before timing).

`PAGEDSERVE_MLA_PREFILL` picks the path for prompt chunks (the first table); decodes are
always absorbed. The second table shows why, on a decode batch: absorbed with the heads
folded into query rows (what the engine runs), absorbed as H heads over one broadcast K
(SDPA's grouped-query path, the engine's first form), and expanded per request.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import torch.nn.functional as F

from pagedserve.attention.mla import absorb_query, attend_absorbed, attend_expanded, mla_attention
from pagedserve.attention.torch_backend import build_metadata, gather_blocks

RANK, ROPE, NOPE, V, BLOCK = 512, 64, 128, 128, 16


def case(heads: int, decodes: list[int], prefills: list[tuple[int, int]]):
    """decodes: context length per decode; prefills: (cached prefix, chunk length)."""
    next_block = 0

    def blocks_for(n: int) -> np.ndarray:
        nonlocal next_block
        count = -(-n // BLOCK)
        ids = np.arange(next_block, next_block + count, dtype=np.int64)
        next_block += count
        return ids

    dec = [(blocks_for(ctx), ctx - 1) for ctx in decodes]
    pre = [(blocks_for(start + n), start, n) for start, n in prefills]
    meta, _ = build_metadata(dec, pre, BLOCK, None, torch.device("cpu"))
    tokens = len(decodes) + sum(n for _, n in prefills)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(next_block * BLOCK, 1, RANK + ROPE, generator=gen)
    tensors = dict(q_nope=torch.randn(tokens, heads, NOPE, generator=gen),
                   q_rope=torch.randn(tokens, heads, ROPE, generator=gen),
                   latent=torch.randn(tokens, RANK, generator=gen), k_rope=torch.randn(tokens, ROPE, generator=gen),
                   cache=cache, w_kv=torch.randn(heads * (NOPE + V), RANK, generator=gen) * RANK ** -0.5)
    return meta, tensors


def timed(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16, help="query heads on this rank (DeepSeek-V3: 128 / TP)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    scale = (NOPE + ROPE) ** -0.5
    cases = {
        "prefill 512 (no prefix)": ([], [(0, 512)]),
        "chunk 256 after 1024 cached": ([], [(1024, 256)]),
        "mixed: 8 decodes + chunk 256": ([1024] * 8, [(512, 256)]),
    }
    print(f"MLA attention, one layer, {args.heads} heads/rank, CPU, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")
    print(f"{'case':32s} {'absorb s':>10s} {'expand s':>10s} {'expand/absorb':>14s}")
    with torch.no_grad():
        for name, (dec, pre) in cases.items():
            meta, t = case(args.heads, dec, pre)

            def run(mode: str) -> torch.Tensor:
                return mla_attention(t["q_nope"], t["q_rope"], t["latent"], t["k_rope"], t["cache"], t["w_kv"],
                                     NOPE, meta, scale, mode=mode)

            torch.testing.assert_close(run("absorb"), run("expand"), rtol=1e-3, atol=1e-3)
            absorb, expand = timed(lambda: run("absorb"), args.repeat), timed(lambda: run("expand"), args.repeat)
            print(f"{name:32s} {absorb:10.4f} {expand:10.4f} {expand / absorb:14.2f}")
        decode_batch(args.heads, args.repeat, scale)


def decode_batch(heads: int, repeat: int, scale: float, batch: int = 16, ctx: int = 1024) -> None:
    meta, t = case(heads, [ctx] * batch, [])
    w = t["w_kv"].view(heads, NOPE + V, RANK)
    w_k, w_v = w[:, :NOPE], w[:, NOPE:]
    entries = gather_blocks(t["cache"], meta.decode_blocks, meta.block_size).transpose(1, 2)  # [B, 1, C, W]
    q_abs = absorb_query(t["q_nope"], t["q_rope"], w_k).unsqueeze(2)                          # [B, H, 1, W]

    def folded():
        return torch.einsum("bhr,hvr->bhv", attend_absorbed(q_abs, entries, RANK, scale, meta.decode_mask,
                                                            causal=False).squeeze(2), w_v)

    def broadcast_heads():
        o = F.scaled_dot_product_attention(q_abs, entries, entries[..., :RANK], attn_mask=meta.decode_mask,
                                           scale=scale, enable_gqa=True)
        return torch.einsum("bhr,hvr->bhv", o.squeeze(2), w_v)

    def expanded():
        return torch.stack([attend_expanded(t["q_nope"][i:i + 1], t["q_rope"][i:i + 1], entries[i, 0], t["w_kv"],
                                            RANK, NOPE, scale, None, causal=False)[0] for i in range(batch)])

    torch.testing.assert_close(folded(), expanded(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(folded(), broadcast_heads(), rtol=1e-3, atol=1e-3)
    base = timed(folded, repeat)
    print(f"\ndecode batch {batch} x ctx {ctx}:  seconds   / absorbed-folded")
    for name, fn in (("absorbed, heads folded (engine)", folded), ("absorbed, H heads, broadcast K", broadcast_heads),
                     ("expanded per request", expanded)):
        sec = base if fn is folded else timed(fn, repeat)
        print(f"  {name:32s} {sec:8.4f} {sec / base:8.2f}")


if __name__ == "__main__":
    main()
