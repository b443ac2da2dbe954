"""pagedserve's CPU GEMM (model/cpu/gemm.cpp) vs MKL (F.linear) vs prepacked oneDNN, per layer
shape and batch size M, side by side in one run; fp32, or bf16 (where the CPU has AVX512-BF16:
F.linear bf16 is then oneDNN with a per-call weight reorder, "onednn" the prepacked weight).

    OMP_NUM_THREADS=1 python benchmarks/cpu_gemm.py                      # M = 1, 8, 32, 256
    OMP_NUM_THREADS=1 python benchmarks/cpu_gemm.py --rows 512,4096      # prefill sizes
    OMP_NUM_THREADS=1 python benchmarks/cpu_gemm.py --dtype bfloat16     # bf16 kernel vs oneDNN bf16
    python benchmarks/cpu_gemm.py --threads 2
    python benchmarks/cpu_gemm.py --threads 2 --rows 1,2,4 --cold-mb 256   # cold weights, GB/s

Shapes: the 19M and 246M peer models' layers (qkv, o, gate_up, down, lm_head). Each number is the
best of `--repeats` interleaved timings (the methods take turns, the order reversed every other
repetition, so a burst of load hits
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
process holds one of its cores, and the fastest tenth are the calls that nothing slowed. Each
cell ends with the bound: the longer of the weight read at the faster stream's rate and the
FLOPs at an FMA loop's rate on these threads (stream_read.cpp's ps_fma_peak, one thread's
rate by its CPU time, times the threads), each method's fraction of it, and the 10th
percentile of the calling thread's CPU time per call (at two threads: the caller's share,
its wait for the other thread included). Prepacked oneDNN is timed too where it is available.

`--before SRC` adds "before": another gemm.cpp (e.g. main's), built with the same flags and
called on the same packed weights, interleaved with the others (an A/B of a kernel change in
one process); `--vs-fp32` (bf16 only) adds "fp32": this checkout's fp32 path on fp32 copies of
the same weights (cold: GB/s of its own fp32 bytes; the bf16/fp32 time ratio is printed).
`--cpu-time` (one thread) times by the thread's CPU time, which a preempting process does not
add to: the steadiest figure on a shared machine (cache interference still shows).
`--shapes qkv,o,gate_up,down,lm_head` picks layers (the LM head at prefill sizes is slow and,
in the engine, only ever sees the last row of each sequence).
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import gemm_build, quantile  # noqa: E402 (benchmarks/ is the script's directory)

SHAPES = {"19m": [(512, 256), (256, 256), (1376, 256), (256, 688), (32000, 256)],
          "246m": [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816), (32000, 1024)]}
LAYERS = ("qkv", "o", "gate_up", "down", "lm_head")  # the order of each model's SHAPES


def call_lib(lib, x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor) -> None:
    """out = x @ W^T through `lib` (a gemm.cpp build), no bias; x and out contiguous."""
    m, k = x.shape
    n = packed.shape[0] * packed.shape[2]
    fn = lib.ps_gemm_bf16 if packed.dtype == torch.bfloat16 else lib.ps_gemm
    fn(x.data_ptr(), k, m, k, packed.data_ptr(), n, None, out.data_ptr(), n, torch.get_num_threads())


def best_seconds(fn, calls: int, clock=time.perf_counter) -> float:
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) / calls


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
    lib.ps_fma_peak.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ps_fma_peak.restype = ctypes.c_double
    return lib


def fma_peak(lib, threads: int) -> float:
    """FLOP/s of `threads` cores issuing nothing but independent FMAs (stream_read.cpp): one
    thread's rate by its CPU time (best of 5; a preempting process does not lower it), times
    `threads`."""
    best = 0.0
    for _ in range(5):
        t0 = time.thread_time()
        flops = lib.ps_fma_peak(1, 2_000_000)
        best = max(best, flops / (time.thread_time() - t0))
    return best * threads



def in_turn(fns: dict, rep: int) -> list:
    """The methods in order, reversed every other repetition: whichever runs second after
    another method ran ~5-10% faster in an A/A run of one build against itself (M = 8-32)."""
    items = list(fns.items())
    return items if rep % 2 == 0 else items[::-1]


def cold(model: str, n: int, k: int, rows: list[int], args, dtype: torch.dtype) -> None:
    """GB/s of weight read per method over copies of the weight larger than the caches, cycled."""
    from pagedserve.model.cpu import gemm

    read = stream_reader().ps_stream_read
    size = n * k * dtype.itemsize
    copies = max(2, math.ceil(args.cold_mb * 2**20 / size))
    plain = [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(copies)]
    packed = [gemm.pack(w) for w in plain]
    fp32 = [gemm.pack(w.float()) for w in plain] if args.vs_fp32 else None
    prepacked = [args.onednn.pack(w) for w in plain] if args.onednn is not None else None
    threads = torch.get_num_threads()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    cells = []
    for m in rows:
        x = torch.randn(m, k).to(dtype)
        torch.testing.assert_close(gemm.linear(x, packed[0], None).float(), F.linear(x.float(), plain[0].float()), **tol)
        out = torch.empty(m, n, dtype=dtype)
        floats = size // 4  # stream_read counts 4-byte words
        fns = {"stream": lambda i: read(packed[i].data_ptr(), floats, threads, 0),
               "stream+pf": lambda i: read(packed[i].data_ptr(), floats, threads, 4096),
               "mkl": lambda i: F.linear(x, plain[i]),
               "ours": lambda i: gemm.linear(x, packed[i], None)}
        if prepacked is not None:
            fns["onednn"] = lambda i: args.onednn.apply(x, prepacked[i], None)
        if args.before_lib is not None:  # both through call_lib: the same Python work per call
            fns["after"] = lambda i: call_lib(gemm.load_gemm(), x, packed[i], out)
            fns["before"] = lambda i: call_lib(args.before_lib, x, packed[i], out)
        if fp32 is not None:
            x32, out32 = x.float(), torch.empty(m, n)
            fns["fp32"] = lambda i: call_lib(gemm.load_gemm(), x32, fp32[i], out32)
        times: dict[str, list[float]] = {name: [] for name in fns}
        cpu: dict[str, list[float]] = {name: [] for name in fns}  # the calling thread's CPU time
        clock = args.clock
        for round_ in range(args.repeats + 1):  # round 0 warms up
            for name, fn in in_turn(fns, round_):
                for i in range(copies):
                    c0, t0 = time.thread_time(), clock()
                    fn(i)
                    if round_:
                        times[name].append(clock() - t0)
                        cpu[name].append(time.thread_time() - c0)
        p10 = {name: quantile(t, 0.1) for name, t in times.items()}
        med = {name: quantile(t, 0.5) for name, t in times.items()}
        # The bound: the weight read at the faster stream's rate, or the FLOPs at the FMA loop's
        # rate on these threads, whichever takes longer.
        bound = max(min(p10["stream"], p10["stream+pf"]), 2 * m * n * k / args.peak)
        nbytes = {name: size * (2 if name == "fp32" and dtype == torch.bfloat16 else 1) for name in fns}
        extra = f" before/after {p10['before'] / p10['after']:.2f}" if "before" in fns else ""
        extra += f" fp32/ours {p10['fp32'] / p10['ours']:.2f}" if "fp32" in fns else ""
        cells.append(f"M={m}: " + " ".join(f"{name} {nbytes[name] / p10[name] / 1e9:5.1f} ({nbytes[name] / med[name] / 1e9:5.1f})"
                                           for name in fns)
                     + f" ours/stream {min(p10['stream'], p10['stream+pf']) / p10['ours']:.2f}{extra}, {p10['ours'] * 1e6:.0f} us"
                     + f" [bound {bound * 1e6:.0f} us: ours {bound / p10['ours']:.2f}, mkl {bound / p10['mkl']:.2f}"
                     + (f", onednn {bound / p10['onednn']:.2f}" if "onednn" in p10 else "")
                     + f"; thread CPU p10 ours {quantile(cpu['ours'], 0.1) * 1e6:.0f} us, mkl {quantile(cpu['mkl'], 0.1) * 1e6:.0f} us]")
    print(f"{model} {n}x{k} ({size / 2**20:.1f} MiB x {copies}): " + " | ".join(cells), flush=True)
    del plain, packed, fp32, prepacked


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--models", default="19m,246m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--cold-mb", type=int, default=0,
                    help="cycle weight copies totalling this many MB (cold weights) and print GB/s")
    ap.add_argument("--before", default=None, help="another gemm.cpp to time beside this checkout's")
    ap.add_argument("--vs-fp32", action="store_true", help="bf16: also this checkout's fp32 path on fp32 weights")
    ap.add_argument("--shapes", default=",".join(LAYERS), help="layers to time: " + ",".join(LAYERS))
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the thread's CPU time (one thread only): a call that another process "
                         "preempted is not charged for the wait")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time needs --threads 1: the GEMM then runs on the calling thread")
    clock = args.clock = time.thread_time if args.cpu_time else time.perf_counter
    dtype = getattr(torch, args.dtype)
    args.vs_fp32 = args.vs_fp32 and dtype == torch.bfloat16
    layers = set(args.shapes.split(","))
    torch.set_num_threads(args.threads)
    from pagedserve.model.cpu import gemm
    from pagedserve.model.layers import LINEAR_METHODS

    onednn = LINEAR_METHODS["onednn"]
    has_onednn = onednn.available(dtype, torch.device("cpu"))
    rows = [int(m) for m in args.rows.split(",")]
    if not gemm.panel_width(dtype):
        raise SystemExit(f"the CPU GEMM has no {args.dtype} kernel on this CPU")
    args.before_lib = gemm_build(args.before) if args.before else None
    load = f"load average {os.getloadavg()[0]:.1f}"
    if args.cold_mb:
        args.onednn = onednn if has_onednn else None
        args.peak = fma_peak(stream_reader(), args.threads) * (2 if dtype == torch.bfloat16 else 1)
        print(f"{args.dtype}, torch threads {torch.get_num_threads()}, cold: >= {args.cold_mb} MB of weight "
              f"copies cycled; GB/s of weight read; FMA loop {args.peak / 1e9:.1f} GFLOP/s "
              f"(bf16: 2x the fp32 loop's, vdpbf16ps' rate); {load}")
        for model in args.models.split(","):
            for layer, (n, k) in zip(LAYERS, SHAPES[model]):
                if layer in layers:
                    cold(model, n, k, rows, args, dtype)
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
        return
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    print(f"{args.dtype}, torch threads {torch.get_num_threads()}, panel width {gemm.panel_width(dtype)}; "
          f"GFLOP/s, (ours / F.linear) [ours / onednn] {{before: before/after time}} {{fp32: fp32/ours time}}; {load}")
    for model in args.models.split(","):
        for layer, (n, k) in zip(LAYERS, SHAPES[model]):
            if layer not in layers:
                continue
            weight = (torch.randn(n, k) * 0.02).to(dtype)
            packed = gemm.pack(weight)
            packed32 = gemm.pack(weight.float()) if args.vs_fp32 else None
            prepacked = onednn.pack(weight) if has_onednn else None
            cells = []
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                torch.testing.assert_close(gemm.linear(x, packed, None).float(), F.linear(x.float(), weight.float()), **tol)
                calls = max(2, int(2e8 / (2 * m * n * k)))
                fns = {"mkl": lambda: F.linear(x, weight), "ours": lambda: gemm.linear(x, packed, None)}
                if prepacked is not None:
                    fns["onednn"] = lambda: onednn.apply(x, prepacked, None)
                out = torch.empty(m, n, dtype=dtype)
                if args.before_lib is not None:  # both through call_lib: the same Python work per call
                    fns["after"] = lambda: call_lib(gemm.load_gemm(), x, packed, out)
                    fns["before"] = lambda: call_lib(args.before_lib, x, packed, out)
                if packed32 is not None:
                    x32, out32 = x.float(), torch.empty(m, n)
                    fns["fp32"] = lambda: call_lib(gemm.load_gemm(), x32, packed32, out32)
                best = {name: float("inf") for name in fns}
                for name, fn in fns.items():
                    fn()  # warm-up (oneDNN creates its primitive on the first call)
                for rep in range(args.repeats):
                    for name, fn in in_turn(fns, rep):
                        best[name] = min(best[name], best_seconds(fn, calls, clock))
                rate = {name: 2 * m * n * k / s / 1e9 for name, s in best.items()}
                dnn = f" onednn {rate['onednn']:6.1f}" if "onednn" in rate else ""
                vs_dnn = f" [{best['onednn'] / best['ours']:.2f}x]" if "onednn" in rate else ""
                vs = f" after {rate['after']:6.1f} before {rate['before']:6.1f} {{{best['before'] / best['after']:.2f}x}}" \
                    if "before" in rate else ""
                vs += f" fp32 {rate['fp32']:6.1f} {{{best['fp32'] / best['ours']:.2f}x}}" if "fp32" in rate else ""
                cells.append(f"M={m}: mkl {rate['mkl']:6.1f}{dnn} ours {rate['ours']:6.1f} ({best['mkl'] / best['ours']:.2f}x){vs_dnn}{vs}")
            print(f"{model} {n}x{k}: " + " | ".join(cells), flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
