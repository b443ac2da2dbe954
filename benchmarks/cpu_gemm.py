"""pagedserve's CPU GEMM (model/cpu/gemm.cpp) vs MKL (F.linear) vs prepacked oneDNN, per layer
shape and batch size M, side by side in one run; fp32, or bf16 (where the CPU has AVX512-BF16:
F.linear bf16 is then oneDNN with a per-call weight reorder, "onednn" the prepacked weight).

    OMP_NUM_THREADS=1 python benchmarks/cpu_gemm.py                      # M = 1, 8, 32, 256
    OMP_NUM_THREADS=1 python benchmarks/cpu_gemm.py --rows 512,4096      # prefill sizes
    OMP_NUM_THREADS=1 python benchmarks/cpu_gemm.py --dtype bfloat16     # bf16 kernel vs oneDNN bf16
    python benchmarks/cpu_gemm.py --threads 2
    python benchmarks/cpu_gemm.py --threads 2 --rows 1,2,4 --cold-mb 256   # cold weights, GB/s

Shapes: the 19M and 246M peer models' layers (qkv, o, gate_up, down, lm_head). Each number is the
best of `--repeats` interleaved timings (the three methods take turns, so a burst of load hits
them alike), in GFLOP/s; the ratio is ours / F.linear. Every output is checked against F.linear
first. The weight is the same one call after call, so weights that fit the caches are warm:
read these as kernel efficiency; the engine's own step (step_breakdown.py) shows the cold case.

`--cold-mb S` measures the cold case instead, as a decode step sees it: every method cycles
through copies of the weight totalling at least S MB (256 = 8x this machine's 32 MB L3), a
different copy each call, so each call reads its weight from memory. It prints GB/s of weight
read (N x K x 4 bytes per call) for F.linear (MKL on the plain weights), ours (the packed ones),
"stream" (a plain read of the same packed bytes on the same threads, each thread its own
contiguous slice: stream_read.cpp) and "stream+pf" (that read with a software prefetch into L2
4 KB ahead): what a GEMV could reach; ours/stream is against the faster of the two. Every call
is timed alone and the figure is the 10th percentile of the per-call times, the median in
brackets: on a shared machine a two-thread call waits a whole time slice whenever another
process holds one of its cores, and the fastest tenth are the calls that nothing slowed.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import quantile  # noqa: E402 (benchmarks/ is the script's directory)

SHAPES = {"19m": [(512, 256), (256, 256), (1376, 256), (256, 688), (32000, 256)],
          "246m": [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816), (32000, 1024)]}


def best_seconds(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def stream_reader():
    """ps_stream_read(p, n, threads) from stream_read.cpp, built like the engine's kernels."""
    from pagedserve import native

    source = Path(__file__).with_name("stream_read.cpp")
    compiler = native.find_compiler()
    path = native.library_path(source, compiler)
    if not path.exists():
        native.compile_library(compiler, source, path)
    lib = ctypes.CDLL(str(path))
    lib.ps_stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64]
    lib.ps_stream_read.restype = ctypes.c_double
    return lib.ps_stream_read



def cold(model: str, n: int, k: int, rows: list[int], args, dtype: torch.dtype) -> None:
    """GB/s of weight read per method over copies of the weight larger than the caches, cycled."""
    from pagedserve.model.cpu import gemm

    read = stream_reader()
    size = n * k * dtype.itemsize
    copies = max(2, math.ceil(args.cold_mb * 2**20 / size))
    plain = [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(copies)]
    packed = [gemm.pack(w) for w in plain]
    threads = torch.get_num_threads()
    cells = []
    for m in rows:
        x = torch.randn(m, k).to(dtype)
        torch.testing.assert_close(gemm.linear(x, packed[0], None).float(), F.linear(x.float(), plain[0].float()),
                                   rtol=1e-4, atol=1e-4)
        fns = {"stream": lambda i: read(packed[i].data_ptr(), n * k, threads, 0),
               "stream+pf": lambda i: read(packed[i].data_ptr(), n * k, threads, 4096),
               "mkl": lambda i: F.linear(x, plain[i]),
               "ours": lambda i: gemm.linear(x, packed[i], None)}
        times: dict[str, list[float]] = {name: [] for name in fns}
        clock = time.perf_counter
        for round_ in range(args.repeats + 1):  # round 0 warms up
            for name, fn in fns.items():
                for i in range(copies):
                    t0 = clock()
                    fn(i)
                    if round_:
                        times[name].append(clock() - t0)
        p10 = {name: quantile(t, 0.1) for name, t in times.items()}
        med = {name: quantile(t, 0.5) for name, t in times.items()}
        cells.append(f"M={m}: " + " ".join(f"{name} {size / p10[name] / 1e9:5.1f} ({size / med[name] / 1e9:5.1f})"
                                           for name in fns)
                     + f" ours/stream {min(p10['stream'], p10['stream+pf']) / p10['ours']:.2f}, {p10['ours'] * 1e6:.0f} us")
    print(f"{model} {n}x{k} ({size / 2**20:.1f} MiB x {copies}): " + " | ".join(cells), flush=True)
    del plain, packed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--models", default="19m,246m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--cold-mb", type=int, default=0,
                    help="cycle weight copies totalling this many MB (cold weights) and print GB/s")
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
    if args.cold_mb:
        print(f"{args.dtype}, torch threads {torch.get_num_threads()}, cold: >= {args.cold_mb} MB of weight "
              f"copies cycled; GB/s of weight read")
        for model in args.models.split(","):
            for n, k in SHAPES[model]:
                cold(model, n, k, rows, args, dtype)
        return
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
