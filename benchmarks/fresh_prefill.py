"""Fresh causal prefill chunks, one layer: torch's SDPA (one call per chunk, as cpu_backend sent
them before issue 32's tiled path) vs the kernel's tiled path (ps_fresh_prefill), best of --repeats.

    OMP_NUM_THREADS=1 python benchmarks/fresh_prefill.py --threads 1     # thread CPU time
    python benchmarks/fresh_prefill.py --threads 2                       # wall time
    python benchmarks/fresh_prefill.py --threads 1 --routing             # the short-chunk crossover

GFLOP/s count the causal half (4 * head_dim * heads * L^2 / 2 per chunk). --routing times whole
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

from pagedserve.attention import cpu_backend
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--routing", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"threads {args.threads}, {'thread CPU' if args.threads == 1 else 'wall'} time, best of {args.repeats}; "
          f"load {os.getloadavg()[0]:.2f}")
    (routing if args.routing else kernels)(args, clock, [torch.float32, torch.bfloat16])
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
