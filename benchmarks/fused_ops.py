"""The fused CPU elementwise ops (pagedserve/model/cpu/fused.py) per call, fp32 beside bf16, at one
model's shapes, in thread CPU time (steady on a shared machine), one thread.

    OMP_NUM_THREADS=1 python benchmarks/fused_ops.py [--rows 32] [--hidden 1024 --inter 2816 --heads 16 --kv-heads 4 --head-dim 64]

Defaults are the 246M peer model's shapes. Best of `--repeats` runs of `--calls` calls each.
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import torch

    from pagedserve.model.cpu import fused

    torch.set_num_threads(1)
    r = args.rows
    rows = {}
    for dt in (torch.float32, torch.bfloat16):
        x, res = torch.randn(r, args.hidden).to(dt), torch.randn(r, args.hidden).to(dt)
        w = torch.randn(args.hidden).to(dt)
        gate_up = torch.randn(r, 2 * args.inter).to(dt)
        q, k = torch.randn(r, args.heads, args.head_dim).to(dt), torch.randn(r, args.kv_heads, args.head_dim).to(dt)
        cos, sin = torch.randn(r, args.head_dim).to(dt), torch.randn(r, args.head_dim).to(dt)
        ops = {"rms_norm": lambda: fused.rms_norm(x, w, 1e-5), "add_rms_norm": lambda: fused.add_rms_norm(x, res, w, 1e-5),
               "silu_and_mul": lambda: fused.silu_and_mul(gate_up), "rotary": lambda: fused.apply_rotary(q, k, cos, sin)}
        for name, fn in ops.items():
            for _ in range(10):
                fn()
            best = float("inf")
            for _ in range(args.repeats):
                t = time.thread_time()
                for _ in range(args.calls):
                    fn()
                best = min(best, (time.thread_time() - t) / args.calls * 1e6)
            rows.setdefault(name, {})[str(dt).split(".")[-1]] = best
    print(f"{r} rows, hidden {args.hidden}, inter {args.inter}, {args.heads}/{args.kv_heads} heads x {args.head_dim}; "
          f"us per call, thread CPU, one thread; load average {os.getloadavg()[0]:.2f}")
    print(f"{'op':<14}{'float32':>10}{'bfloat16':>10}   bf16/fp32")
    for name, v in rows.items():
        print(f"{name:<14}{v['float32']:>10.1f}{v['bfloat16']:>10.1f}   {v['bfloat16'] / v['float32']:.2f}x")


if __name__ == "__main__":
    main()
