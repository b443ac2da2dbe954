"""Preemption modes side by side under a pool that forces heavy preemption.

    python benchmarks/preemption.py                  # 100M random Llama
    python benchmarks/preemption.py --size 20m

recompute drops a victim's KV and prefills it again; swap copies its blocks to host memory
and back; auto picks per victim from measured host-copy bandwidth and prefill cost.
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
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=320)
    ap.add_argument("--num-kv-blocks", type=int, default=160, help="pool size: small enough to preempt often")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = benchmark_checkpoint(args.size)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    work = make_workload("random", args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                         range_ratio=0.5, vocab_size=vocab, seed=args.seed)
    results, chosen = {}, {}
    for mode in ("recompute", "swap", "auto"):
        llm = LLM(str(path), max_model_len=min(1024, args.num_kv_blocks * 16), num_kv_blocks=args.num_kv_blocks,
                  preemption_mode=mode,
                  swap_space="2GiB", max_num_seqs=args.max_num_seqs, dtype="float32", enable_prefix_caching=False)
        run = run_in_process(llm.engine, work,
                             lambda w: SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True))
        results[mode] = summarize(run)
        sched = llm.engine.scheduler
        results[mode]["recomputed_tokens"] = sched.total_recomputed_tokens
        results[mode]["blocks_swapped_out"] = sched.total_blocks_swapped["out"]
        chosen[mode] = dict(sched.total_preemptions_by_mode)
        del llm
    print(f"{args.num_prompts} requests, prompts ~{args.input_len}, outputs ~{args.output_len}, pool "
          f"{args.num_kv_blocks} blocks x 16 tokens; model {args.size}")
    print_side_by_side("", results, ["output_throughput", "mean_e2el_ms", "p99_e2el_ms", "p99_itl_ms",
                                     "preemptions", "recomputed_tokens", "blocks_swapped_out"])
    print("preemptions by mode actually taken:", chosen)
    best = max(results["recompute"]["output_throughput"], results["swap"]["output_throughput"])
    print(f"auto throughput vs the better fixed mode: {results['auto']['output_throughput'] / best:.3f}x")
    print(f"wrote {write_result('preemption', {'args': vars(args), 'results': results, 'modes': chosen})}")


if __name__ == "__main__":
    main()
