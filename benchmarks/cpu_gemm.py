"""pagedserve's CPU GEMM (model/cpu/gemm.cpp) vs MKL (F.linear) vs prepacked oneDNN, per layer
shape and batch size M, side by side in one run; fp32, or bf16 (where the CPU has AVX512-BF16:
F.linear bf16 is then oneDNN with a per-call weight reorder, "onednn" the prepacked weight).

    OMP_NUM_THREADS=1 python benchmarks/cpu_gemm.py                      # M = 1, 8, 32, 256
    OMP_NUM_THREADS=1 python benchmarks/cpu_gemm.py --rows 512,4096      # prefill sizes
    OMP_NUM_THREADS=1 python benchmarks/cpu_gemm.py --dtype bfloat16     # bf16 kernel vs oneDNN bf16
    python benchmarks/cpu_gemm.py --threads 2

Shapes: the 19M and 246M peer models' layers (qkv, o, gate_up, down, lm_head). Each number is the
best of `--repeats` interleaved timings (the three methods take turns, so a burst of load hits
them alike), in GFLOP/s; the ratio is ours / F.linear. Every output is checked against F.linear
first. The weight is the same one call after call, so weights that fit the caches are warm:
read these as kernel efficiency; the engine's own step (step_breakdown.py) shows the cold case.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"19m": [(512, 256), (256, 256), (1376, 256), (256, 688), (32000, 256)],
          "246m": [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816), (32000, 1024)]}


def best_seconds(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--models", default="19m,246m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    from pagedserve.model.cpu import gemm
    from pagedserve.model.layers import LINEAR_METHODS

    onednn = LINEAR_METHODS["onednn"]
    has_onednn = onednn.available(dtype, torch.device("cpu"))
    rows = [int(m) for m in args.rows.split(",")]
    if not gemm.panel_width(dtype):
        raise SystemExit(f"the CPU GEMM has no {args.dtype} kernel on this CPU")
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    print(f"{args.dtype}, torch threads {torch.get_num_threads()}, panel width {gemm.panel_width(dtype)}; "
          f"GFLOP/s, (ours / F.linear) [ours / onednn]")
    for model in args.models.split(","):
        for n, k in SHAPES[model]:
            weight = (torch.randn(n, k) * 0.02).to(dtype)
            packed = gemm.pack(weight)
            prepacked = onednn.pack(weight) if has_onednn else None
            cells = []
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                torch.testing.assert_close(gemm.linear(x, packed, None).float(), F.linear(x.float(), weight.float()), **tol)
                calls = max(2, int(2e8 / (2 * m * n * k)))
                fns = {"mkl": lambda: F.linear(x, weight), "ours": lambda: gemm.linear(x, packed, None)}
                if prepacked is not None:
                    fns["onednn"] = lambda: onednn.apply(x, prepacked, None)
                best = {name: float("inf") for name in fns}
                for name, fn in fns.items():
                    fn()  # warm-up (oneDNN creates its primitive on the first call)
                for _ in range(args.repeats):
                    for name, fn in fns.items():
                        best[name] = min(best[name], best_seconds(fn, calls))
                rate = {name: 2 * m * n * k / s / 1e9 for name, s in best.items()}
                dnn = f" onednn {rate['onednn']:6.1f}" if "onednn" in rate else ""
                vs_dnn = f" [{best['onednn'] / best['ours']:.2f}x]" if "onednn" in rate else ""
                cells.append(f"M={m}: mkl {rate['mkl']:6.1f}{dnn} ours {rate['ours']:6.1f} ({best['mkl'] / best['ours']:.2f}x){vs_dnn}")
            print(f"{model} {n}x{k}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
