"""The fused CPU elementwise ops (pagedserve/model/cpu/fused.py) per call, fp32 beside bf16, at one
model's shapes, in thread CPU time (steady on a shared machine), one thread.

    OMP_NUM_THREADS=1 python benchmarks/fused_ops.py [--rows 32] [--hidden 1024 --inter 2816 --heads 16 --kv-heads 4 --head-dim 64]
    OMP_NUM_THREADS=1 python benchmarks/fused_ops.py --ops silu_and_mul --rows 1 32 2048 --torch

Defaults are the 246M peer model's shapes (19M's: --hidden 256 --inter 688 --heads 4 --kv-heads 2).
Best of `--repeats` runs of up to `--calls` calls each (fewer for a slow call: each run lasts
about `--run-seconds`). `--rows` takes several values, one table each. `--torch` adds a column
for the torch expressions the op replaces, as HF writes them (SiLU: F.silu(gate) * up on
contiguous gate and up, the tensors HF's MLP has) and, for SiLU, a memory reference: torch.mul
of the gate and up views into a kept output, the same bytes read and written with no exp.
"""
from __future__ import annotations

import argparse
import os
import time

OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary")


def best_us(fn, calls: int, repeats: int, run_seconds: float) -> float:
    """Best per-call thread CPU time over `repeats` runs, in microseconds."""
    for _ in range(3):
        fn()
    t = time.thread_time()
    fn()
    one = max(time.thread_time() - t, 1e-7)
    calls = max(3, min(calls, int(run_seconds / one)))
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t) / calls * 1e6)
    return best


def table(args, r: int) -> None:
    import torch
    import torch.nn.functional as F

    from pagedserve.model.cpu import fused
    from pagedserve.scratch import ScratchOutput

    rows: dict[str, dict[str, float]] = {}
    for dt in (torch.float32, torch.bfloat16):
        x, res = torch.randn(r, args.hidden).to(dt), torch.randn(r, args.hidden).to(dt)
        w = torch.randn(args.hidden).to(dt)
        gate_up = torch.randn(r, 2 * args.inter).to(dt)
        gate, up = gate_up[:, :args.inter].contiguous(), gate_up[:, args.inter:].contiguous()
        q, k = torch.randn(r, args.heads, args.head_dim).to(dt), torch.randn(r, args.kv_heads, args.head_dim).to(dt)
        cos, sin = torch.randn(r, args.head_dim).to(dt), torch.randn(r, args.head_dim).to(dt)
        silu_scratch = ScratchOutput()  # as the model's MLP calls it (kept at decode sizes only)
        ops = {"rms_norm": lambda: fused.rms_norm(x, w, 1e-5), "add_rms_norm": lambda: fused.add_rms_norm(x, res, w, 1e-5),
               "silu_and_mul": lambda: fused.silu_and_mul(gate_up, silu_scratch), "rotary": lambda: fused.apply_rotary(q, k, cos, sin)}
        torch_ops = {"rms_norm": lambda: fused.rms_norm_reference(x, w, 1e-5),
                     "add_rms_norm": lambda: fused.add_rms_norm_reference(x, res, w, 1e-5),
                     "silu_and_mul": lambda: F.silu(gate) * up,
                     "rotary": lambda: fused.apply_rotary_reference(q, k, cos, sin)}
        mul_out = torch.empty(r, args.inter, dtype=dt)
        same_bytes = lambda: torch.mul(gate_up[:, :args.inter], gate_up[:, args.inter:], out=mul_out)  # noqa: E731
        name_dt = str(dt).split(".")[-1]
        for name in args.ops:
            rows.setdefault(name, {})[name_dt] = best_us(ops[name], args.calls, args.repeats, args.run_seconds)
            if args.torch:
                rows[name][f"torch {name_dt}"] = best_us(torch_ops[name], args.calls, args.repeats, args.run_seconds)
                if name == "silu_and_mul":
                    rows[name][f"mul {name_dt}"] = best_us(same_bytes, args.calls, args.repeats, args.run_seconds)
    print(f"{r} rows, hidden {args.hidden}, inter {args.inter}, {args.heads}/{args.kv_heads} heads x {args.head_dim}; "
          f"us per call, thread CPU, one thread; load average {os.getloadavg()[0]:.2f}")
    extra = f"{'torch fp32':>12}{'torch bf16':>12}" if args.torch else ""
    if args.torch and "silu_and_mul" in rows:
        extra += f"{'mul fp32':>10}{'mul bf16':>10}   (mul: same bytes, no exp)"
    print(f"{'op':<14}{'float32':>10}{'bfloat16':>10}   bf16/fp32{extra}")
    for name, v in rows.items():
        line = f"{name:<14}{v['float32']:>10.1f}{v['bfloat16']:>10.1f}   {v['bfloat16'] / v['float32']:>8.2f}x"
        if args.torch:
            line += f"{v['torch float32']:>12.1f}{v['torch bfloat16']:>12.1f}"
            if "mul float32" in v:
                line += f"{v['mul float32']:>10.1f}{v['mul bfloat16']:>10.1f}"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[32])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    ap.add_argument("--torch", action="store_true", help="also time the torch expressions each op replaces")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--run-seconds", type=float, default=0.3)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    for r in args.rows:
        table(args, r)


if __name__ == "__main__":
    main()
