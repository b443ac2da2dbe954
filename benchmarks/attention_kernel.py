"""Per-layer decode attention + KV write: torch reference backend vs the compiled CPU kernel,
side by side in one run, and (with --engine) the whole engine step with each backend.

    python benchmarks/attention_kernel.py                       # 246M shape: 16 heads, 4 kv heads, head_dim 64
    python benchmarks/attention_kernel.py --dtype bfloat16
    python benchmarks/attention_kernel.py --prefill             # one prefill chunk: reference vs SDPA vs kernel
    python benchmarks/attention_kernel.py --engine --size 100m  # decode-heavy engine run, backend torch vs cpu

Layer mode: for each (sequences, context) it builds a pool with shuffled block ids, builds each
backend's step metadata, then times `paged_attention` (write + attend) over enough separate
layer caches that the rotation does not fit the CPU's caches (as in a real forward, where
each layer's K/V are cold). Backends alternate repeat by repeat; the median is reported.
Engine mode: one engine whose backend is flipped between runs (alternating), best of N, in
wall tok/s and in tokens per CPU-second of this process (with --threads 1 the steadier number
on a shared machine: it leaves out the time spent waiting for a core).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pagedserve.attention import cpu_backend, torch_backend  # noqa: E402
from pagedserve.attention.cpu import load_kernel  # noqa: E402

ROTATION_BYTES = 256 << 20  # K/V touched per rotation of layer caches: well past any LLC here


def make_case(num_seqs: int, ctx: int, block_size: int, kv_heads: int, head_dim: int, dtype, rng):
    blocks_per_seq = -(-(ctx + 1) // block_size)
    num_blocks = num_seqs * blocks_per_seq + 8
    ids = rng.permutation(num_blocks)
    decodes = [(ids[i * blocks_per_seq:(i + 1) * blocks_per_seq].astype(np.int64), ctx) for i in range(num_seqs)]
    layer_bytes = 2 * num_seqs * (ctx + 1) * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    num_layers = max(1, min(16, -(-ROTATION_BYTES // layer_bytes)))
    pools = [torch.randn(2, num_blocks * block_size, kv_heads, head_dim).to(dtype) for _ in range(num_layers)]
    return decodes, pools


def time_backend(backend, decodes, pools, q, k, v, block_size, scale, min_seconds: float) -> tuple[float, float]:
    """(seconds per layer for write + attention, seconds per step for the metadata)."""
    t0 = time.perf_counter()
    meta, _ = backend.build_metadata(decodes, [], block_size, None, torch.device("cpu"))
    meta_s = time.perf_counter() - t0
    calls = 0
    t0 = time.perf_counter()
    while True:
        for pool in pools:
            backend.paged_attention(q, k, v, pool[0], pool[1], meta, scale)
        calls += len(pools)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return elapsed / calls, meta_s


def time_write(write, pools, k, v, slots, min_seconds: float) -> float:
    calls = 0
    t0 = time.perf_counter()
    while True:
        for pool in pools:
            write(k, v, pool[0], pool[1], slots)
        calls += len(pools)
        if (elapsed := time.perf_counter() - t0) >= min_seconds:
            return elapsed / calls


def torch_write(k, v, k_cache, v_cache, slots):
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def layer_mode(args) -> None:
    dtype = getattr(torch, args.dtype)
    load_kernel()
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    scale = head_dim ** -0.5
    print(f"per layer, decode: {heads} heads / {kv_heads} kv heads x {head_dim}, block {bs}, {args.dtype}, "
          f"torch threads={torch.get_num_threads()}; times in us, ratio = torch / kernel (higher = kernel faster)")
    print(f"{'seqs':>5}{'ctx':>6} | {'write torch':>11}{'kernel':>8}{'ratio':>7} | {'write+attn torch':>16}"
          f"{'kernel':>9}{'ratio':>7} | {'metadata/step torch':>19}{'kernel':>8}")
    results = []
    for num_seqs in args.seqs:
        for ctx in args.ctx:
            decodes, pools = make_case(num_seqs, ctx, bs, kv_heads, head_dim, dtype, rng)
            fused = torch.randn(num_seqs, (heads + 2 * kv_heads) * head_dim).to(dtype)
            q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
            q = q.reshape(num_seqs, heads, head_dim)   # the model's q is a fresh tensor after RoPE
            k = k.reshape(num_seqs, kv_heads, head_dim)
            v = v.view(num_seqs, kv_heads, head_dim)   # and v a view into the fused projection
            meta, _ = cpu_backend.build_metadata(decodes, [], bs, None, torch.device("cpu"))
            slots = meta.slot_mapping
            for backend in (torch_backend, cpu_backend):  # warm-up: first touch of every pool page
                time_backend(backend, decodes, pools, q, k, v, bs, scale, 0.0)
            samples = {"torch": [], "cpu": [], "torch_w": [], "cpu_w": [], "torch_m": [], "cpu_m": []}
            for _ in range(args.repeats):
                for name, backend, write in (("torch", torch_backend, torch_write),
                                             ("cpu", cpu_backend, cpu_backend.write_kv)):
                    step_s, meta_s = time_backend(backend, decodes, pools, q, k, v, bs, scale, args.min_seconds)
                    samples[name].append(step_s)
                    samples[name + "_m"].append(meta_s)
                    samples[name + "_w"].append(time_write(write, pools, k, v, slots, args.min_seconds / 4))
            med = {key: statistics.median(vals) * 1e6 for key, vals in samples.items()}
            print(f"{num_seqs:>5}{ctx:>6} | {med['torch_w']:>11.1f}{med['cpu_w']:>8.1f}{med['torch_w'] / med['cpu_w']:>6.1f}x"
                  f" | {med['torch']:>16.1f}{med['cpu']:>9.1f}{med['torch'] / med['cpu']:>6.1f}x"
                  f" | {med['torch_m']:>19.1f}{med['cpu_m']:>8.1f}", flush=True)
            results.append({"seqs": num_seqs, "ctx": ctx, **{f"{k}_us": v for k, v in med.items()}})
            del pools
    out = ROOT / "results"
    out.mkdir(exist_ok=True)
    (out / "attention_kernel.json").write_text(json.dumps({"args": vars(args), "layer": results}, indent=2))


def prefill_mode(args) -> None:
    """One prefill chunk of n tokens after `start` cached ones: the torch reference (SDPA; a
    gather and a mask when start > 0), SDPA causal over the chunk's own K/V (start 0 only),
    and the kernel reading the pool. cpu_backend.KERNEL_MAX_FRESH_CHUNK / KERNEL_MAX_CACHED_CHUNK
    (longer chunks go to SDPA) come from this table."""
    dtype = getattr(torch, args.dtype)
    load_kernel()
    heads, kv_heads, head_dim, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    scale = head_dim ** -0.5
    rng = np.random.default_rng(0)
    print(f"per layer, one prefill chunk: {heads} heads / {kv_heads} kv heads x {head_dim}, {args.dtype}, "
          f"torch threads={torch.get_num_threads()}; us, ratio = reference / kernel")
    print(f"{'start':>6}{'tokens':>7} | {'reference':>10}{'sdpa own':>10}{'kernel':>9}{'ref/kernel':>11}{'sdpa/kernel':>12}")
    routed = cpu_backend.KERNEL_MAX_FRESH_CHUNK, cpu_backend.KERNEL_MAX_CACHED_CHUNK
    for start in args.prefix:
        for n in args.chunk:
            blocks_needed = -(-(start + n) // bs)
            num_blocks = blocks_needed + 8
            blocks = rng.permutation(num_blocks)[:blocks_needed].astype(np.int64)
            pools = [torch.randn(2, num_blocks * bs, kv_heads, head_dim).to(dtype) for _ in range(4)]
            fused = torch.randn(n, (heads + 2 * kv_heads) * head_dim).to(dtype)
            q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
            q, k, v = q.reshape(n, heads, head_dim), k.reshape(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)
            prefills = [(blocks, start, n)]
            timings: dict[str, list[float]] = {"ref": [], "sdpa": [], "kernel": []}
            for _ in range(args.repeats):
                timings["ref"].append(time_prefill(torch_backend, prefills, pools, q, k, v, bs, scale, args.min_seconds))
                for name, limit in (("sdpa", 0), ("kernel", 1 << 30)):
                    if name == "sdpa" and start > 0:
                        timings[name].append(float("nan"))
                        continue
                    cpu_backend.KERNEL_MAX_FRESH_CHUNK = cpu_backend.KERNEL_MAX_CACHED_CHUNK = limit
                    timings[name].append(time_prefill(cpu_backend, prefills, pools, q, k, v, bs, scale,
                                                      args.min_seconds))
                cpu_backend.KERNEL_MAX_FRESH_CHUNK, cpu_backend.KERNEL_MAX_CACHED_CHUNK = routed
            med = {key: statistics.median(vals) * 1e6 for key, vals in timings.items()}
            print(f"{start:>6}{n:>7} | {med['ref']:>10.1f}{med['sdpa']:>10.1f}{med['kernel']:>9.1f}"
                  f"{med['ref'] / med['kernel']:>10.2f}x{med['sdpa'] / med['kernel']:>11.2f}x", flush=True)


def time_prefill(backend, prefills, pools, q, k, v, block_size, scale, min_seconds: float) -> float:
    meta, _ = backend.build_metadata([], prefills, block_size, None, torch.device("cpu"))
    backend.paged_attention(q, k, v, pools[0][0], pools[0][1], meta, scale)
    calls = 0
    t0 = time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_seconds or calls == 0:
        for pool in pools:
            backend.paged_attention(q, k, v, pool[0], pool[1], meta, scale)
        calls += len(pools)
    return elapsed / calls


def engine_mode(args) -> None:
    """One engine, one pool; the backend is flipped between generate() calls (both read the
    same pool layout), alternating, so both see the same machine state. Best of N per backend."""
    from common import benchmark_checkpoint

    from pagedserve import LLM, SamplingParams
    from pagedserve import attention

    path = args.model or benchmark_checkpoint(args.size)
    llm = LLM(str(path), dtype="float32", max_model_len=args.prompt_len + args.new_tokens + 16,
              max_num_seqs=args.engine_seqs, max_num_batched_tokens=4096, enable_prefix_caching=False,
              kv_cache_memory="2GiB")
    rng = np.random.default_rng(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[int(t) for t in rng.integers(3, vocab, size=args.prompt_len)] for _ in range(args.engine_seqs)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    print(f"engine: {args.model or 'random Llama ' + args.size}, {args.engine_seqs} sequences x ({args.prompt_len} prompt + "
          f"{args.new_tokens} new tokens), fp32, greedy, torch threads={torch.get_num_threads()}; output tok/s")
    best: dict[str, float] = {}
    tokens: dict[str, list] = {}
    for run in range(args.engine_runs + 1):  # run 0 warms both up and is not counted
        for backend in ("torch", "cpu"):
            os.environ[attention.BACKEND_ENV] = backend
            attention.backend_for.cache_clear()
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
            assert attention.backend_for("cpu") == backend
            tokens.setdefault(backend, [o.outputs[0].token_ids for o in outs])
            num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            tok_s, tok_cpu_s = num_tokens / seconds, num_tokens / cpu_seconds
            if run:
                best[backend] = max(best.get(backend, 0.0), tok_s)
                best[backend + "_cpu"] = max(best.get(backend + "_cpu", 0.0), tok_cpu_s)
            print(f"  run {run}{' (warm-up)' if not run else ''} {backend:>5}: {tok_s:8.1f} tok/s ({seconds:.1f} s wall),"
                  f" {tok_cpu_s:8.1f} tok per CPU-second", flush=True)
    same = sum(a == b for a, b in zip(tokens["torch"], tokens["cpu"]))
    print(f"best of {args.engine_runs}: torch {best['torch']:.1f} tok/s, cpu kernel {best['cpu']:.1f} tok/s, "
          f"ratio {best['cpu'] / best['torch']:.2f}x (per CPU-second: {best['torch_cpu']:.1f} vs {best['cpu_cpu']:.1f}, "
          f"{best['cpu_cpu'] / best['torch_cpu']:.2f}x); greedy outputs identical for {same}/{len(prompts)} requests")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32, 256])
    ap.add_argument("--ctx", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-seconds", type=float, default=0.05, help="per timed sample")
    ap.add_argument("--prefill", action="store_true", help="time one prefill chunk per layer instead of decodes")
    ap.add_argument("--prefix", type=int, nargs="+", default=[0, 512])
    ap.add_argument("--chunk", type=int, nargs="+", default=[4, 16, 32, 64, 128, 512])
    ap.add_argument("--engine", action="store_true", help="time whole engine runs instead of one layer")
    ap.add_argument("--size", default="100m", help="random checkpoint size (benchmarks/common.py)")
    ap.add_argument("--model", default=None, help="a checkpoint directory instead of --size")
    ap.add_argument("--engine-seqs", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--engine-runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.engine:
        engine_mode(args)
    elif args.prefill:
        prefill_mode(args)
    else:
        layer_mode(args)


if __name__ == "__main__":
    main()
