"""`pagedserve plan`: the KV-cache memory budget, computed from memory rather than guessed."""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..config import KV_CACHE_DTYPES
from ..utils import parse_bytes
from .budget import DEFAULT_GPU_OVERHEAD_TP1, DEFAULT_GPU_OVERHEAD_TP_N, PlanRequest, compute_plan
from .gpus import custom_gpu, get_gpu, gpu_names
from .kv_budget import DTYPE_BYTES
from .models import generic_model, load_model, preset_names
from .report import plan_to_dict, render_text

EXIT_USAGE = 2

_DESCRIPTION = """\
Where GPU memory goes (weights, activations, sampler, overhead, KV cache), how many
tokens fit in the KV pool, and how high max_num_seqs can go. The pool is cut into blocks
by the same functions the engine uses at start-up, so a plan and a start-up agree.
"""


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a whole number, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {value}")
        return value
    return parse


def _fraction(flag: str, low_open: bool = True):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {text!r}") from None
        ok = (0 < value <= 1) if low_open else (0 <= value < 1)
        if not ok:
            raise argparse.ArgumentTypeError(f"{flag} must be in {'(0, 1]' if low_open else '[0, 1)'}, got {value}")
        return value
    return parse


def _byte_size(flag: str):
    def parse(text: str) -> int:
        try:
            return parse_bytes(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{flag}: {exc}") from None
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", help=f"directory with config.json, a config.json path, or a preset: {', '.join(preset_names())}")
    model.add_argument("--layers", type=_positive_int("--layers"), help="generic form: number of decoder layers")
    model.add_argument("--hidden-size", type=_positive_int("--hidden-size"))
    model.add_argument("--heads", type=_positive_int("--heads"), help="attention (query) heads")
    model.add_argument("--kv-heads", type=_positive_int("--kv-heads"), help="KV heads (GQA); default = --heads (MHA)")
    model.add_argument("--head-dim", type=_positive_int("--head-dim"))
    model.add_argument("--vocab-size", type=_positive_int("--vocab-size"))
    model.add_argument("--intermediate-size", type=_positive_int("--intermediate-size"))
    dtypes = sorted(DTYPE_BYTES)
    model.add_argument("--dtype", choices=dtypes, help="weight dtype (default: the checkpoint's)")
    model.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="KV cache dtype, as `serve` takes it; auto = the activation dtype; fp8 (= fp8_e4m3) "
                            "halves the KV of bf16; int8 adds a 4-byte scale per token and KV head")

    device = parser.add_argument_group("device")
    device.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    device.add_argument("--gpu", help=f"GPU preset: {', '.join(gpu_names())} (default H100-SXM)")
    device.add_argument("--gpu-memory", type=_byte_size("--gpu-memory"), help="any other GPU: its memory, e.g. 24GiB")
    device.add_argument("--memory", type=_byte_size("--memory"), help="with --device cpu: memory for the engine, e.g. 24GiB")
    device.add_argument("--tensor-parallel-size", "-tp", type=_positive_int("--tensor-parallel-size"), default=1)
    device.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int("--pipeline-parallel-size"), default=1,
                        help="pipeline stages: the layers are split between them (KV per GPU shrinks with them)")
    device.add_argument("--data-parallel-size", "-dp", type=_positive_int("--data-parallel-size"), default=1,
                        help="replicas of the model (with --enable-expert-parallel: attention replicated, "
                             "experts spread)")
    device.add_argument("--enable-expert-parallel", action="store_true",
                        help="spread whole MoE experts over the TP x DP GPUs of a stage instead of sharding each")
    device.add_argument("--expert-parallel-size", "-ep", type=_positive_int("--expert-parallel-size"), default=None,
                        help="the expert-parallel group size; implies --enable-expert-parallel and must equal TP x DP")

    budget = parser.add_argument_group("budget")
    budget.add_argument("--gpu-memory-utilization", type=_fraction("--gpu-memory-utilization"), default=0.9)
    budget.add_argument("--kv-cache-memory", type=_byte_size("--kv-cache-memory"),
                        help="byte budget for the KV pool directly (always used on CPU); overrides utilization")
    budget.add_argument("--max-model-len", type=_positive_int("--max-model-len"),
                        help="default: the model's max_position_embeddings")
    budget.add_argument("--max-num-seqs", type=_positive_int("--max-num-seqs"),
                        help="sizes the sampler buffer (default: vLLM's server default, 1024 on >=70 GiB GPUs "
                             "other than A100, else 256) and is checked against the pool")
    budget.add_argument("--max-num-batched-tokens", type=_positive_int("--max-num-batched-tokens"),
                        help="token budget per step; sizes the activation peak (default: vLLM's server default, "
                             "8192 on >=70 GiB GPUs other than A100, else 2048)")
    budget.add_argument("--block-size", type=_positive_int("--block-size"), default=16)
    budget.add_argument("--mean-seq-len", type=_positive_int("--mean-seq-len"),
                        help="the workload's mean prompt+output length (default min(2048, max_model_len))")
    budget.add_argument("--margin", type=_fraction("--margin", low_open=False), default=0.2,
                        help="share of the pool kept free when recommending max_num_seqs")
    budget.add_argument("--overhead", type=_byte_size("--overhead"),
                        help="non-torch + CUDA-graph memory per GPU (default "
                             f"{DEFAULT_GPU_OVERHEAD_TP1 >> 30} GiB at TP 1, {DEFAULT_GPU_OVERHEAD_TP_N >> 30} GiB "
                             "under TP, from vLLM's measured non-torch memory; 0 on CPU)")
    budget.add_argument("--activation-memory", type=_byte_size("--activation-memory"),
                        help="measured activation peak per GPU; overrides the estimate")
    budget.add_argument("--sampler-memory", type=_byte_size("--sampler-memory"),
                        help="sampler/logits buffer per GPU; overrides max_num_seqs x vocab x 4 x 3")
    budget.add_argument("--swap-space", type=_byte_size("--swap-space"), default=4 << 30,
                        help="host memory per rank for swapped-out blocks, as serve takes it (default 4GiB; 0 = none): "
                             "the plan says how much of it is resident")
    budget.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                        help="host KV tier over all ranks, as serve takes it: the plan says how many prefix "
                             "tokens it keeps beside the pool")
    parser.add_argument("--layouts", default=None, metavar="L1,L2",
                        help="compare parallel layouts side by side, e.g. TP8,TP8+EP8,TP4xPP2,DP8+EP8 "
                             "(each replaces -tp/-pp/-dp/--enable-expert-parallel)")
    parser.add_argument("--replicas", type=_positive_int("--replicas"), default=None,
                        help="a fleet of N such replicas (serve --replicas): print its totals after the plan")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def register(subparsers) -> None:
    """Add the `plan` sub-command to an argparse subparsers object."""
    parser = subparsers.add_parser("plan", help="KV-cache memory budget and recommended knobs",
                                   description=_DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(func=run)


def build_request(args: argparse.Namespace) -> PlanRequest:
    """Turn parsed flags into a PlanRequest; raises ValueError naming the flag at fault."""
    generic = args.layers is not None
    if args.model and generic:
        raise ValueError("give either --model or the generic form (--layers ...), not both")
    if args.model:
        model = load_model(args.model)
    elif generic:
        model = generic_model(num_layers=args.layers, hidden_size=args.hidden_size, num_heads=args.heads,
                              num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                              intermediate_size=args.intermediate_size, vocab_size=args.vocab_size)
    else:
        raise ValueError("--model (a config.json, its directory, or a preset) or --layers is required")

    if args.device == "cpu":
        if args.gpu or args.gpu_memory:
            raise ValueError("--gpu/--gpu-memory do not apply with --device cpu (use --memory)")
        device = custom_gpu(args.memory or 0, name="CPU")
    else:
        if args.memory:
            raise ValueError("--memory is for --device cpu; for a GPU use --gpu-memory")
        if args.gpu and args.gpu_memory:
            raise ValueError("give --gpu or --gpu-memory, not both")
        device = custom_gpu(args.gpu_memory) if args.gpu_memory else get_gpu(args.gpu or "H100-SXM")
        if device.memory_bytes <= 0:
            raise ValueError("--gpu-memory must be > 0")

    return PlanRequest(
        model=model, device=device, device_kind=args.device, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size, data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, expert_parallel_size=args.expert_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        mean_seq_len=args.mean_seq_len, margin=args.margin, overhead=args.overhead,
        activation_memory=args.activation_memory, sampler_memory=args.sampler_memory,
        swap_space=args.swap_space, kv_offloading_size=args.kv_offloading_size,
    )


def compare_layouts(req, layouts: list[str]) -> list:
    """One plan per layout, the rest of the request unchanged."""
    from dataclasses import replace

    from .parallel import parse_layout

    plans = []
    for name in layouts:
        layout = parse_layout(name)
        plans.append(compute_plan(replace(
            req, tensor_parallel_size=layout.tp, pipeline_parallel_size=layout.pp, data_parallel_size=layout.dp,
            enable_expert_parallel=layout.expert_parallel, expert_parallel_size=layout.expert_parallel_size)))
    return plans


def render_layouts(plans: list) -> str:
    from .report import format_bytes

    req = plans[0].request
    lines = [f"pagedserve plan: {req.model.name} ({plans[0].num_params / 1e9:.2f}B params, weights "
             f"{plans[0].weight_dtype}, KV {plans[0].kv_dtype}) on {req.device.name}, "
             f"max_model_len {plans[0].max_model_len:,}", "",
             f"  {'layout':<14} {'GPUs':>4} {'weights/GPU':>12} {'KV B/token/GPU':>15} {'KV pool tokens':>15} "
             f"{'max concurrency':>16}  fits"]
    for p in plans:
        lines.append(f"  {p.layout.describe():<14} {p.layout.num_gpus:>4} {format_bytes(p.parts[0].bytes):>12} "
                     f"{p.kv_bytes_per_token:>15,} {p.pool.num_tokens:>15,} {p.max_concurrency_at_max_model_len:>15.2f}x"
                     f"  {'yes' if p.fits else 'no'}")
    for p in plans:
        for w in p.warnings:
            lines.append(f"  - {p.layout.describe()}: {w}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the plan; 0 on success, 2 (message on stderr) on a bad value."""
    if args.layouts:
        try:
            plans = compare_layouts(build_request(args), [x.strip() for x in args.layouts.split(",") if x.strip()])
        except ValueError as exc:
            print(f"pagedserve plan: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(json.dumps([plan_to_dict(p) for p in plans], indent=2) if args.json else render_layouts(plans))
        return 0
    try:
        plan = compute_plan(build_request(args))
    except ValueError as exc:
        print(f"pagedserve plan: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    replicas = getattr(args, "replicas", None)
    if args.json:
        payload = plan_to_dict(plan)
        if replicas:
            payload["fleet"] = fleet_totals(plan, replicas)
        text = json.dumps(payload, indent=2)
    else:
        text = render_text(plan) + (("\n" + render_fleet(plan, replicas)) if replicas else "")
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `pagedserve plan ... | head`
        sys.stdout = open(os.devnull, "w")
    return 0


def fleet_totals(plan, replicas: int) -> dict:
    """A fleet of `replicas` copies of the planned engine: each holds its own weights and KV pool
    (replicas share nothing), so every total is the replica's times N."""
    gpus = plan.layout.num_gpus if plan.request.device_kind == "gpu" else 0
    pool_tokens = plan.pool.num_blocks * plan.pool.block_size
    return {
        "replicas": replicas, "gpus_per_replica": gpus, "gpus": gpus * replicas,
        "device_memory_bytes": plan.request.device.memory_bytes * max(gpus, 1) * replicas,
        "weight_bytes": plan.weight_bytes_total * replicas,
        "kv_pool_bytes": plan.kv_pool_budget_bytes * max(gpus, 1) * replicas,
        "kv_pool_tokens_per_replica": pool_tokens, "kv_pool_tokens": pool_tokens * replicas,
        "max_concurrency_at_max_model_len": plan.max_concurrency_at_max_model_len * replicas,
        "concurrency_at_mean": plan.concurrency_at_mean * replicas,
    }


def render_fleet(plan, replicas: int) -> str:
    t = fleet_totals(plan, replicas)
    gib = 1 << 30
    where = f"{t['gpus']} GPUs ({t['gpus_per_replica']} per replica)" if t["gpus"] else "CPU replicas"
    return "\n".join([
        f"Fleet: {replicas} replicas, {where}",
        f"  weights     {t['weight_bytes'] / gib:8.2f} GiB in all (each replica loads its own copy)",
        f"  KV pools    {t['kv_pool_bytes'] / gib:8.2f} GiB in all, {t['kv_pool_tokens']:,} tokens "
        f"({t['kv_pool_tokens_per_replica']:,} per replica; a prefix cached on one is not on the others)",
        f"  concurrency {t['concurrency_at_mean']:8.1f} sequences at the mean length, "
        f"{t['max_concurrency_at_max_model_len']:.1f} at max_model_len",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve plan", description=_DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
