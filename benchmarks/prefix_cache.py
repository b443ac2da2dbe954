"""Prefix caching on vs off: requests sharing a long system prompt.

    python benchmarks/prefix_cache.py                # 100M random Llama
    python benchmarks/prefix_cache.py --size 20m
"""
from __future__ import annotations

import argparse
import json

from common import benchmark_checkpoint, print_side_by_side, run_in_process, summarize, write_result
from pagedserve import LLM, SamplingParams
from pagedserve.bench.workloads import make_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="100m")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = benchmark_checkpoint(args.size)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    work = make_workload("prefix-repetition", args.num_prompts, request_rate=args.request_rate, seed=args.seed,
                         prefix_len=args.prefix_len, suffix_len=args.suffix_len, num_prefixes=1,
                         output_len=args.output_len, vocab_size=vocab)
    results = {}
    for name, caching in (("cache on", True), ("cache off", False)):
        llm = LLM(str(path), max_model_len=2048, kv_cache_memory="2GiB", enable_prefix_caching=caching,
                  dtype="float32")
        run = run_in_process(llm.engine, work,
                             lambda w: SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True))
        kv = llm.engine.kv_cache_manager
        results[name] = {**summarize(run), "hit_rate": kv.prefix_hits / max(kv.prefix_queries, 1),
                         "prompt_tokens_computed": kv.prefix_queries - kv.prefix_hits}
        del llm
    print(f"{args.num_prompts} requests at {args.request_rate} req/s sharing a {args.prefix_len}-token prefix "
          f"(+{args.suffix_len} own tokens, {args.output_len} out); model {args.size}")
    print_side_by_side("", results, ["hit_rate", "prompt_tokens_computed", "output_throughput", "mean_ttft_ms",
                                     "p99_ttft_ms", "mean_e2el_ms"], ratio_of=("cache off", "cache on"))
    print(f"wrote {write_result('prefix_cache', {'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
