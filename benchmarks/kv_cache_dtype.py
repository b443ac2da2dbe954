"""KV cache dtypes side by side (`--kv-cache-dtype auto | fp8 | fp8_e5m2 | int8`), one run:

    python benchmarks/kv_cache_dtype.py                    # capacity, accuracy, throughput
    python benchmarks/kv_cache_dtype.py --parts capacity accuracy
    python benchmarks/kv_cache_dtype.py --parts throughput --throughput-model 20m \
        --pressure-memory 18MiB --roomy-memory 72MiB     # a 13M random Llama instead

- capacity: the engine's own start-up lines (KV cache size, maximum concurrency, bytes per
  token) at one `--kv-cache-memory`, for a float32 and a bfloat16 model;
- accuracy, on the built-in default model: held-out perplexity by teacher forcing (prompt
  logprobs over windows of the held-out standard-library files, prefilled in chunks so that
  later chunks read the KV the engine wrote) and greedy agreement with the unquantized cache
  (share of identical tokens up to each sequence's first divergence);
- throughput: the same offline workload at the same KV memory, where the unquantized pool
  preempts and the 8-bit pools do not (output tok/s, preemptions, P99 ITL), and again at 4x the
  memory, where the float32 pool holds as many tokens as fp8's did and nothing preempts: what
  the 8-bit formats' quantize and decode cost;
- dequant: one layer's decode attention per cache format on the CPU kernel, and the extra
  seconds per K/V value read (the simulator's `kv_dequant_s_per_value` for a CPU cost model).
"""
from __future__ import annotations

import argparse
import logging
import re

from common import benchmark_checkpoint, print_side_by_side, run_in_process, summarize, write_result
from pagedserve import LLM, SamplingParams
from pagedserve.bench.default_model_eval import (BOS_ID, EOS_ID, agreement, greedy_tokens, held_out_files,
                                                 held_out_windows, stdlib_source_files, teacher_forced_perplexity)
from pagedserve.bench.workloads import make_workload
from pagedserve.cpu_isa import cpu_features
from pagedserve.default_model_path import DEFAULT_MODEL_DIR

KV_DTYPES = ("auto", "fp8", "fp8_e5m2", "int8")


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def startup_lines(**engine_args) -> list[str]:
    """The engine's start-up log (only the engine is built; nothing runs)."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine import Engine

    handler = LogLines()
    logger = logging.getLogger("pagedserve.engine")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        Engine(EngineConfig(**engine_args))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return handler.lines


def capacity(kv_cache_memory: str, max_model_len: int) -> dict:
    # bfloat16 on a CPU without hardware bf16 computes in float32 (config.resolve_dtype): skip it there
    model_dtypes = ["float32"] + (["bfloat16"] if cpu_features().fast_bf16 else [])
    table = {}
    for model_dtype in model_dtypes:
        for kv in KV_DTYPES:
            lines = startup_lines(model=str(DEFAULT_MODEL_DIR), dtype=model_dtype, kv_cache_dtype=kv,
                                  kv_cache_memory=kv_cache_memory, max_model_len=max_model_len)
            text = "\n".join(lines)
            tokens = int(re.search(r"KV cache size: ([\d,]+) tokens", text).group(1).replace(",", ""))
            conc = float(re.search(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", text).group(1))
            dtype_line = re.search(r"KV cache dtype: (\S+), ([\d,]+) bytes per token", text)
            table[(model_dtype, kv)] = dict(tokens=tokens, concurrency=conc, stored=dtype_line.group(1),
                                            bytes_per_token=int(dtype_line.group(2).replace(",", "")))
    print(f"\n## Capacity: built-in model, --kv-cache-memory {kv_cache_memory}, max_model_len {max_model_len}")
    print("| model dtype | --kv-cache-dtype | stored as | bytes/token | pool tokens | max concurrency | vs auto |")
    print("|---|---|---|---:|---:|---:|---:|")
    for (model_dtype, kv), row in table.items():
        base = table[(model_dtype, "auto")]
        print(f"| {model_dtype} | {kv} | {row['stored']} | {row['bytes_per_token']:,} | {row['tokens']:,} | "
              f"{row['concurrency']:.2f}x | {row['tokens'] / base['tokens']:.2f}x |")
    return {f"{m}/{k}": v for (m, k), v in table.items()}


def training_split_windows(tokenizer, num_windows: int, window_len: int) -> list[list[int]]:
    """Windows from the training split's first files (not the held-out text): calibration data."""
    held_out = set(held_out_files())
    stream: list[int] = []
    for path in stdlib_source_files():
        if path in held_out:
            continue
        stream += [BOS_ID, *tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"),
                                             add_special_tokens=False, verbose=False), EOS_ID]
        if len(stream) >= num_windows * window_len:
            break
    return [stream[i * window_len:(i + 1) * window_len] for i in range(num_windows)]


def calibrated_fp8_scales(windows: list[list[int]], chunk: int) -> tuple[list[float], list[float]]:
    """Per-layer K and V scales amax / 448 (E4M3's largest), amax over an unquantized run on
    `windows`: what a calibrated checkpoint would carry instead of vLLM's default scale 1."""
    import pagedserve.model.llama as llama_module

    original = llama_module.paged_attention
    layer_of: dict[int, int] = {}
    amax: dict[int, list[float]] = {}

    def recording(q, k, v, k_cache, v_cache, meta, scale):
        layer = layer_of.setdefault(k_cache.data_ptr(), len(layer_of))  # layers run in order
        seen = amax.setdefault(layer, [0.0, 0.0])
        seen[0], seen[1] = max(seen[0], k.abs().max().item()), max(seen[1], v.abs().max().item())
        return original(q, k, v, k_cache, v_cache, meta, scale)

    llama_module.paged_attention = recording
    try:
        llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=chunk,
                  enable_prefix_caching=False)
        llm.generate(windows, SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        llama_module.paged_attention = original
    e4m3_max = 448.0
    return ([amax[i][0] / e4m3_max for i in range(len(amax))], [amax[i][1] / e4m3_max for i in range(len(amax))])


def accuracy(num_windows: int, window_len: int, num_prompts: int, prompt_len: int, max_tokens: int,
             chunk: int) -> dict:
    results, reference = {}, None
    rows = [(kv, kv) for kv in KV_DTYPES] + [("fp8, calibrated scales", "fp8")]
    for label, kv in rows:
        # `chunk`-token chunks: each window's later chunks read their keys back from the cache
        llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", kv_cache_dtype=kv, kv_cache_memory="256MiB",
                  enable_prefix_caching=False, max_num_batched_tokens=chunk)
        tokenizer = llm.get_tokenizer()
        if label.endswith("calibrated scales"):
            k_scales, v_scales = calibrated_fp8_scales(training_split_windows(tokenizer, 16, window_len), chunk)
            pool = llm.engine.executor.kv_cache
            pool.values.zero_()  # start-up profiling wrote into the pool with the old scales
            pool.set_tensor_scales(k_scales, v_scales)
        windows = held_out_windows(tokenizer, num_windows, window_len)
        ppl = teacher_forced_perplexity(llm, windows)
        prompts = [w[:prompt_len] for w in held_out_windows(tokenizer, num_prompts, window_len * 2)]
        tokens = greedy_tokens(llm, prompts, max_tokens)
        reference = reference or tokens
        results[label] = dict(perplexity=ppl.value, scored_tokens=ppl.num_tokens,
                              agreement=agreement(reference, tokens),
                              identical_sequences=sum(a == b for a, b in zip(reference, tokens)))
        del llm
    base = results["auto"]["perplexity"]
    print(f"\n## Accuracy: built-in model (float32 compute), {num_windows} held-out windows x {window_len} tokens "
          f"({results['auto']['scored_tokens']:,} scored, prefilled in {chunk}-token chunks); "
          f"greedy {num_prompts} prompts x {max_tokens} tokens")
    print("| --kv-cache-dtype | perplexity | vs auto | greedy agreement | identical sequences |")
    print("|---|---:|---:|---:|---:|")
    for label, r in results.items():
        print(f"| {label} | {r['perplexity']:.4f} | {100 * (r['perplexity'] / base - 1):+.2f}% | "
              f"{100 * r['agreement']:.1f}% | {r['identical_sequences']}/{num_prompts} |")
    return results


def throughput(model: str, pressure_memory: str, roomy_memory: str, num_prompts: int, input_len: int,
               output_len: int, max_num_seqs: int, rounds: int) -> dict:
    """Each (memory, dtype) run `rounds` times, alternating, the best round's numbers kept: the
    machine is shared, and a run slowed by a neighbour says nothing about the dtype."""
    import json
    path = DEFAULT_MODEL_DIR if model == "builtin" else benchmark_checkpoint(model)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    work = make_workload("random", num_prompts, input_len=input_len, output_len=output_len, range_ratio=0.5,
                         vocab_size=vocab, seed=0)
    keys = ["output_throughput", "p99_itl_ms", "median_itl_ms", "preemptions", "pool_tokens"]
    configs = [(label, memory, kv) for label, memory in (("pressure", pressure_memory), ("roomy", roomy_memory))
               for kv in ("auto", "fp8", "int8")]
    best: dict[tuple[str, str], dict] = {}
    for _ in range(rounds):
        for label, memory, kv in configs:
            llm = LLM(str(path), dtype="float32", kv_cache_dtype=kv, kv_cache_memory=memory,
                      max_model_len=1024, max_num_seqs=max_num_seqs, enable_prefix_caching=False)
            run = run_in_process(llm.engine, work,
                                 lambda w: SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True))
            result = summarize(run)
            result["pool_tokens"] = llm.engine.pool_sizing.num_tokens
            del llm
            kept = best.get((label, kv))
            if kept is None or result["output_throughput"] > kept["output_throughput"]:
                best[(label, kv)] = result
    tables = {}
    for label, memory in (("pressure", pressure_memory), ("roomy", roomy_memory)):
        tables[label] = {kv: best[(label, kv)] for kv in ("auto", "fp8", "int8")}
        print(f"\n## Throughput ({label}: --kv-cache-memory {memory}): {model} model float32, {num_prompts} "
              f"requests at once, prompts ~{input_len}, outputs ~{output_len}, max_num_seqs {max_num_seqs}; "
              f"best of {rounds} alternating rounds")
        print_side_by_side("", tables[label], keys, ratio_of=("fp8", "auto"))
    return tables


def dequant_cost(num_decodes: int, context: int, repeats: int) -> dict:
    """One layer's paged attention on the CPU backend (the built-in model's heads: 4 query, 2 KV,
    head_dim 64), `num_decodes` decodes of `context` keys each, per cache format: the best of
    `repeats` calls. The extra seconds per K/V value read over the float32 cache are what
    `CostParams.kv_dequant_s_per_value` stands for in a calibrated CPU cost model."""
    import time

    import numpy as np
    import torch

    from pagedserve.attention import cpu_backend
    from pagedserve.attention.kv_quant import FORMATS, QuantizedKVCache
    from pagedserve.worker.model_runner import allocate_zeroed

    heads, kv_heads, head_dim, block_size = 4, 2, 64, 16
    blocks_each = -(-context // block_size)
    num_slots = num_decodes * blocks_each * block_size
    decodes = [(np.arange(i * blocks_each, (i + 1) * blocks_each), context - 1) for i in range(num_decodes)]
    meta, _ = cpu_backend.build_metadata(decodes, [], block_size, None, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(num_decodes, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    values_read = 2 * num_decodes * context * kv_heads * head_dim
    seconds = {}
    for name in ("float32", "fp8_e4m3", "fp8_e5m2", "int8"):
        if name == "float32":
            k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
            v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
        else:
            fmt = FORMATS[name]
            pool = QuantizedKVCache.allocate((1, 2, num_slots, kv_heads, head_dim), fmt, torch.device("cpu"),
                                             allocate_zeroed)
            noise = torch.randn(pool.values.shape, generator=gen)  # normal values, as K/V are
            if fmt.per_token_scales:
                pool.values.copy_((noise * 40).clamp(-127, 127).to(torch.int8))
                pool.scales.fill_(0.025)
            else:
                pool.values.copy_(noise.to(fmt.fp8).view(torch.uint8))
            k_cache, v_cache = pool[0, 0], pool[0, 1]
        cpu_backend.paged_attention(q, k, v, k_cache, v_cache, meta, 0.125)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            cpu_backend.paged_attention(q, k, v, k_cache, v_cache, meta, 0.125)
            times.append(time.perf_counter() - t0)
        seconds[name] = min(times)
    print(f"\n## Dequantization cost: one layer's attention, {num_decodes} decodes x {context} keys "
          f"({values_read:,} K/V values read), CPU kernel, torch threads {torch.get_num_threads()}, "
          f"best of {repeats}")
    print("| cache | ms per layer | vs float32 | extra s per value read |")
    print("|---|---:|---:|---:|")
    base = seconds["float32"]
    for name, t in seconds.items():
        print(f"| {name} | {t * 1e3:.3f} | {t / base:.2f}x | {(t - base) / values_read:.2e} |")
    return {name: dict(seconds=t, extra_s_per_value=(t - base) / values_read) for name, t in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["capacity", "accuracy", "throughput", "dequant"],
                    choices=["capacity", "accuracy", "throughput", "dequant"])
    ap.add_argument("--kv-cache-memory", default="64MiB", help="capacity table's pool budget")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=16, help="held-out windows for perplexity")
    ap.add_argument("--window-len", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64, help="max_num_batched_tokens for the perplexity runs")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pressure-memory", default="12MiB",
                    help="throughput table's pool budget: the float32 pool preempts, fp8's does not")
    ap.add_argument("--roomy-memory", default="48MiB",
                    help="a float32 pool as large as fp8's at --pressure-memory: nothing preempts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--throughput-model", default="builtin", choices=["builtin", "20m", "100m"],
                    help="the throughput tables' model: the built-in one, or a random Llama (common.SIZES)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=192)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    args = ap.parse_args()
    out = {"args": vars(args)}
    if "capacity" in args.parts:
        out["capacity"] = capacity(args.kv_cache_memory, args.max_model_len)
    if "accuracy" in args.parts:
        out["accuracy"] = accuracy(args.windows, args.window_len, args.prompts, args.prompt_len, args.max_tokens,
                                   args.chunk)
    if "throughput" in args.parts:
        out["throughput"] = throughput(args.throughput_model, args.pressure_memory, args.roomy_memory,
                                       args.num_requests, args.input_len, args.output_len, args.max_num_seqs,
                                       args.rounds)
    if "dequant" in args.parts:
        out["dequant"] = dequant_cost(num_decodes=32, context=512, repeats=30)
    print(f"\nwrote {write_result('kv_cache_dtype', out)}")


if __name__ == "__main__":
    main()
