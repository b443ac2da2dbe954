"""Fresh causal prefill chunks, one layer: torch's SDPA (one call per chunk, as cpu_backend sent
them before issue 32's tiled path) vs the kernel's tiled path (ps_fresh_prefill), best of --repeats.

    OMP_NUM_THREADS=1 python benchmarks/fresh_prefill.py --threads 1     # thread CPU time
    python benchmarks/fresh_prefill.py --threads 2                       # wall time
    python benchmarks/fresh_prefill.py --threads 1 --routing             # the short-chunk crossover

    OMP_NUM_THREADS=1 python benchmarks/fresh_prefill.py --threads 1 --cached            # after cached keys
    OMP_NUM_THREADS=1 python benchmarks/fresh_prefill.py --threads 1 --cached-routing    # their crossover

GFLOP/s count the causal half (4 * head_dim * heads * L^2 / 2 per chunk). --cached times one chunk
of n tokens after c cached ones, its K/V already in a pool of shuffled blocks: the SDPA reference
path (torch_backend.attend_prefill_chunk: the context's blocks gathered, a mask) vs the tiled path
over the pool (ps_cached_prefill); GFLOP/s count the keys each query sees (4 * head_dim * heads *
n * (c + n / 2)). --cached-routing times whole cpu_backend.paged_attention calls (the K/V write
included) on 8 chunks of n tokens after c cached ones each: short chunks through the plan's kernel
vs the tiled path. --routing times whole
cpu_backend.paged_attention calls (the K/V write included) on 4,096 (19M) or 2,048 (246M) tokens
cut into chunks of L: every fresh chunk through the plan's kernel ('plan'), the tiled path, or SDPA.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.attention import cpu_backend, torch_backend
from pagedserve.attention.cpu import DTYPE_CODES, load_kernel

CASES = [("19M", 4, 2, 64, 32, 128), ("246M", 16, 4, 64, 16, 128), ("246M", 16, 4, 64, 4, 512),
         ("246M", 16, 4, 64, 64, 48), ("246M", 16, 4, 64, 1, 2048)]


def qkv(tokens, heads, kv_heads, head_dim, dtype):
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    return q.reshape(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)


def sdpa(q, k, v, lens):
    out, row, gqa = torch.empty_like(q), 0, q.shape[1] != k.shape[1]
    for n in lens:
        t = [x[row:row + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
        out[row:row + n] = F.scaled_dot_product_attention(*t, is_causal=True, scale=q.shape[2] ** -0.5,
                                                          enable_gqa=gqa).squeeze(0).transpose(0, 1)
        row += n
    return out


def tiled(q, k, v, lens, threads):
    out = torch.empty_like(q)
    starts = np.cumsum([0] + lens[:-1]).astype(np.int32)
    lens_a = np.array(lens, dtype=np.int32)
    rc = load_kernel().ps_fresh_prefill(len(lens), starts.ctypes.data, lens_a.ctypes.data, q.data_ptr(), q.stride(0),
                                        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
                                        out.stride(0), DTYPE_CODES[str(q.dtype)[6:]], q.shape[1], k.shape[1],
                                        q.shape[2], q.shape[2] ** -0.5, threads)
    assert rc == 0
    return out


def best(fn, clock, repeats):
    fn()
    b = float("inf")
    for _ in range(repeats):
        t = clock()
        fn()
        b = min(b, clock() - t)
    return b


def kernels(args, clock, dtypes):
    for name, heads, kv, d, chunks, n in CASES:
        for dtype in dtypes:
            lens = [n] * chunks
            q, k, v = qkv(n * chunks, heads, kv, d, dtype)
            torch.testing.assert_close(tiled(q, k, v, lens, args.threads).float(), sdpa(q, k, v, lens).float(),
                                       atol=2e-2, rtol=2e-2)
            ts = best(lambda: sdpa(q, k, v, lens), clock, args.repeats)
            tk = best(lambda: tiled(q, k, v, lens, args.threads), clock, args.repeats)
            flop = 4 * d * heads * chunks * n * n / 2
            print(f"{name} {heads}/{kv}x{d} {chunks}x{n} {str(dtype)[6:]}: SDPA {ts * 1e3:.2f} ms "
                  f"({flop / ts / 1e9:.0f} GFLOP/s), tiled {tk * 1e3:.2f} ms ({flop / tk / 1e9:.0f} GFLOP/s), "
                  f"x{ts / tk:.2f}", flush=True)


def routing(args, clock, dtypes):
    bs = 16
    for heads, kv, d, tokens in [(4, 2, 64, 4096), (16, 4, 64, 2048)]:
        for dtype in dtypes:
            for n in [1, 2, 4, 8, 16, 24, 32, 48, 64, 128]:
                chunks = tokens // n
                blocks = np.random.default_rng(0).permutation(chunks * -(-n // bs) + 4)
                per = -(-n // bs)
                prefills = [(blocks[i * per:(i + 1) * per], 0, n) for i in range(chunks)]
                kc = torch.zeros(len(blocks) * bs, kv, d, dtype=dtype)
                vc = torch.zeros_like(kc)
                q, k, v = qkv(chunks * n, heads, kv, d, dtype)
                res = {}
                saved = cpu_backend.KERNEL_MAX_FRESH_CHUNK
                for way, limit in [("plan", 1 << 30), ("tiled", 0), ("SDPA", 0)]:
                    cpu_backend.KERNEL_MAX_FRESH_CHUNK = limit
                    meta, _ = cpu_backend.build_metadata([], prefills, bs, None, torch.device("cpu"))
                    if way == "SDPA":
                        meta.sdpa_chunks, meta.fresh_chunks = meta.fresh_chunks, []
                    res[way] = best(lambda: cpu_backend.paged_attention(q, k, v, kc, vc, meta, d ** -0.5), clock,
                                    args.repeats)
                cpu_backend.KERNEL_MAX_FRESH_CHUNK = saved
                print(f"{heads}/{kv}x{d} {str(dtype)[6:]} {chunks}x{n}: " +
                      ", ".join(f"{w} {t * 1e3:.2f} ms" for w, t in res.items()), flush=True)


CACHED_CASES = [(128, 128), (512, 512), (1536, 512), (2048, 64), (64, 16)]
CACHED_SHAPES = [("246M", 16, 4, 64), ("19M", 4, 2, 64)]


def cached_pool(chunks, c, n, heads, kv, d, dtype, bs=16, seed=0):
    """A pool of shuffled blocks holding `chunks` sequences of c + n tokens (the chunk's own K/V
    written as the step would), q for the chunks' n tokens, and (blocks, c, n) per chunk."""
    per = -(-(c + n) // bs)
    gen = torch.Generator().manual_seed(seed)
    blocks = np.random.default_rng(seed).permutation(chunks * per + 4)
    kc = torch.randn(len(blocks) * bs, kv, d, generator=gen).to(dtype)
    vc = torch.randn(len(blocks) * bs, kv, d, generator=gen).to(dtype)
    q, k, v = qkv(chunks * n, heads, kv, d, dtype)
    prefills = [(blocks[i * per:(i + 1) * per], c, n) for i in range(chunks)]
    return kc, vc, q, k, v, prefills


def cached(args, clock, dtypes):
    bs = 16
    for name, heads, kv, d in CACHED_SHAPES:
        for c, n in CACHED_CASES:
            for dtype in dtypes:
                kc, vc, q, k, v, prefills = cached_pool(1, c, n, heads, kv, d, dtype)
                blocks = prefills[0][0]
                slots = torch.from_numpy(torch_backend.slots_for(blocks, np.arange(c, c + n), bs))
                kc[slots], vc[slots] = k, v
                chunk = torch_backend.prefill_chunk(blocks, c, n, 0, bs, None, torch.device("cpu"))
                plan, arrays = cpu_backend.make_plan([0], [n], [c + n], [blocks], bs, None)
                scale = d ** -0.5
                code = DTYPE_CODES[str(dtype)[6:]]
                ts_ = kc.stride(0)

                def ref():
                    return torch_backend.attend_prefill_chunk(q, k, v, kc, vc, chunk, bs, scale)

                def tiled_pool():
                    out = torch.empty_like(q)
                    rc = load_kernel().ps_cached_prefill(plan, q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(),
                                                         bs * ts_, d, ts_, out.data_ptr(), heads * d, code, heads,
                                                         kv, d, scale, args.threads)
                    assert rc == 0
                    return out

                a, b = tiled_pool().float(), ref().float()
                err = (a - b).abs().max().item()
                torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
                ts = best(ref, clock, args.repeats)
                tk = best(tiled_pool, clock, args.repeats)
                flop = 4 * d * heads * n * (c + n / 2)
                print(f"{name} {heads}/{kv}x{d} c={c} n={n} {str(dtype)[6:]}: SDPA ref {ts * 1e3:.3f} ms "
                      f"({flop / ts / 1e9:.0f} GFLOP/s), tiled {tk * 1e3:.3f} ms ({flop / tk / 1e9:.0f} GFLOP/s), "
                      f"x{ts / tk:.2f}; max |diff| {err:.1e}", flush=True)


def cached_routing(args, clock, dtypes):
    bs = 16
    for name, heads, kv, d in CACHED_SHAPES:
        for dtype in dtypes:
            for c in [64, 512, 2048]:
                for n in [1, 2, 4, 8, 12, 16, 32]:
                    kc, vc, q, k, v, prefills = cached_pool(8, c, n, heads, kv, d, dtype)
                    res = {}
                    saved = cpu_backend.KERNEL_MAX_CACHED_CHUNK
                    for way, limit in [("plan", 1 << 30), ("tiled", 0)]:
                        cpu_backend.KERNEL_MAX_CACHED_CHUNK = limit
                        meta, _ = cpu_backend.build_metadata([], prefills, bs, None, torch.device("cpu"))
                        res[way] = best(lambda: cpu_backend.paged_attention(q, k, v, kc, vc, meta, d ** -0.5), clock,
                                        args.repeats)
                    cpu_backend.KERNEL_MAX_CACHED_CHUNK = saved
                    print(f"{name} {heads}/{kv}x{d} {str(dtype)[6:]} 8x(c={c}, n={n}): " +
                          ", ".join(f"{w} {t * 1e3:.3f} ms" for w, t in res.items()) +
                          f", plan/tiled x{res['plan'] / res['tiled']:.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--routing", action="store_true")
    ap.add_argument("--cached", action="store_true")
    ap.add_argument("--cached-routing", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"threads {args.threads}, {'thread CPU' if args.threads == 1 else 'wall'} time, best of {args.repeats}; "
          f"load {os.getloadavg()[0]:.2f}")
    mode = (routing if args.routing else cached if args.cached else cached_routing if args.cached_routing
            else kernels)
    mode(args, clock, [torch.float32, torch.bfloat16])
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
