"""Chunked prefill on vs off: steady decoders while long prompts arrive (wall-clock, in-process).

    python benchmarks/chunked_prefill.py                 # 100M random Llama
    python benchmarks/chunked_prefill.py --size 20m      # quicker

Without chunking a long prompt runs whole in one step, and every running decode waits for
it; with chunking it is cut into `--chunk`-token pieces that share steps with the decodes.
Reports the steady decoders' inter-token latency (P50/P99/max) and overall throughput.
"""
from __future__ import annotations

import argparse

from common import benchmark_checkpoint, print_side_by_side, run_in_process, summarize, write_result
from pagedserve import LLM, SamplingParams
from pagedserve.bench.workloads import WorkloadRequest


def workload(args, vocab: int):
    import random
    rng = random.Random(args.seed)
    reqs = [WorkloadRequest([rng.randrange(16, vocab) for _ in range(64)], None, 64, args.steady_tokens,
                            0.0, tags={"steady": True}) for _ in range(args.steady)]
    for i in range(args.long):
        n = args.long_len
        reqs.append(WorkloadRequest([rng.randrange(16, vocab) for _ in range(n)], None, n, 8,
                                    args.first_long_at + i * args.long_every, tags={"steady": False}))
    return reqs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="100m")
    ap.add_argument("--steady", type=int, default=8, help="decoding requests present from the start")
    ap.add_argument("--steady-tokens", type=int, default=160)
    ap.add_argument("--long", type=int, default=4, help="long prompts arriving during the run")
    ap.add_argument("--long-len", type=int, default=1536)
    ap.add_argument("--first-long-at", type=float, default=1.0)
    ap.add_argument("--long-every", type=float, default=3.0)
    ap.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens with chunking on")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = benchmark_checkpoint(args.size)
    import json
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    configs = {
        "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=args.chunk),
        "unchunked": dict(enable_chunked_prefill=False, max_num_batched_tokens=2048),
    }
    results = {}
    for name, knobs in configs.items():
        llm = LLM(str(path), max_model_len=2048, kv_cache_memory="2GiB", dtype="float32", **knobs)
        run = run_in_process(llm.engine, workload(args, vocab),
                             lambda w: SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True))
        steady = summarize(run, only=lambda w: w.tags.get("steady"))
        overall = summarize(run)
        prompt_tokens = sum(w.prompt_len for w in run["workload"])
        results[name] = {**steady, "output_throughput": overall["output_throughput"],
                         "total_throughput": (overall["output_tokens"] + prompt_tokens) / run["duration"]}
        del llm
    print(f"{args.steady} steady decoders ({args.steady_tokens} tokens each) + {args.long} prompts of {args.long_len} "
          f"tokens arriving every {args.long_every}s; chunk = {args.chunk} tokens; model {args.size}")
    print_side_by_side("steady decoders' inter-token latency, and throughput:", results,
                       ["median_itl_ms", "p99_itl_ms", "max_itl_ms", "output_throughput", "total_throughput"],
                       ratio_of=("unchunked", "chunked"))
    p99_gain = results["unchunked"]["p99_itl_ms"] / results["chunked"]["p99_itl_ms"]
    tput_loss = 1 - results["chunked"]["total_throughput"] / results["unchunked"]["total_throughput"]
    print(f"P99 ITL {p99_gain:.2f}x lower with chunking; total throughput change {-tput_loss:+.1%}")
    print(f"wrote {write_result('chunked_prefill', {'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
