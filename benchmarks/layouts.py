"""Parallel layouts side by side on the simulator: memory from `pagedserve plan`, speed from
`pagedserve simulate` (sim/parallel_cost.py's TP, EP and PP terms on a node topology).

    python benchmarks/layouts.py [--model deepseek-v3] [--gpu H200] [--gpus 8 16] [--num-prompts 400]

One workload (random prompts, all sent at t=0), one engine config; per layout: weights and
KV bytes per token on one GPU, the KV pool, output tokens/s, ITL and TTFT, and the
throughput ratio to the first layout of the same GPU count. Default: DeepSeek-V3 (fp8) on
8 and 16 H200s, 8 per node. Simulated, not measured: the numbers are the model's.
"""
from __future__ import annotations

import argparse

from pagedserve.bench.workloads import make_workload
from pagedserve.config import EngineConfig
from pagedserve.plan.parallel import parse_layout
from pagedserve.sim.parallel_cost import Topology
from pagedserve.sim.simulator import build_deployment, simulate

LAYOUTS = {
    8: ["TP8", "TP8+EP8", "TP4xPP2", "TP2xPP4"],
    16: ["TP16", "TP16+EP16", "TP8xPP2", "TP8xPP2+EP8", "TP4xPP4"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--gpu", default="H200")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16], choices=sorted(LAYOUTS))
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=400)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    args = ap.parse_args()

    topology = Topology(gpus_per_node=args.gpus_per_node)
    print(f"{args.model} on {args.gpu}, {args.gpus_per_node} GPUs per node; {args.num_prompts} prompts of "
          f"{args.input_len} -> {args.output_len} tokens at t=0; max_num_seqs {args.max_num_seqs}")
    for count in args.gpus:
        print(f"\n{count} GPUs ({-(-count // args.gpus_per_node)} node(s))")
        print(f"{'layout':14s} {'weights/GPU':>11s} {'KV B/tok':>9s} {'pool tok':>10s} {'out tok/s':>10s} "
              f"{'ratio':>6s} {'mean ITL':>9s} {'P99 ITL':>8s} {'mean TTFT':>10s}")
        first = None
        for name in LAYOUTS[count]:
            layout = parse_layout(name)
            assert layout.num_gpus == count, name
            config = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=4096, gpu_memory_utilization=0.9)
            try:
                dep = build_deployment(config, args.model, gpu=args.gpu, layout=layout, topology=topology)
            except ValueError as exc:
                print(f"{name:14s} does not fit: {exc}")
                continue
            workload = make_workload("random", args.num_prompts, input_len=args.input_len,
                                     output_len=args.output_len, range_ratio=0.0,
                                     vocab_size=dep.vocab_size, seed=0)
            result = simulate(dep, workload)
            m = result.metrics
            first = first or m["output_throughput"]
            plan = dep.plan
            print(f"{name:14s} {plan.parts[0].bytes / 2**30:9.1f}Gi {plan.kv_bytes_per_token:>9,} "
                  f"{plan.pool.num_tokens:>10,} {m['output_throughput']:>10.0f} {m['output_throughput'] / first:>6.2f} "
                  f"{m['mean_itl_ms']:>7.1f}ms {m['p99_itl_ms']:>6.1f}ms {m['mean_ttft_ms']:>8.0f}ms")


if __name__ == "__main__":
    main()
