"""Render a Plan: a readable breakdown for people, a JSON document for machines."""
from __future__ import annotations

import shlex

from .budget import Plan, kv_heads_note
from .kv_budget import kv_cache_log_lines, swap_space_line


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == "3.00 GiB"``."""
    size, sign = abs(float(num_bytes)), "-" if num_bytes < 0 else ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{sign}{size:.0f} B" if unit == "B" else f"{sign}{size:.2f} {unit}"
        size /= 1024
    return f"{sign}{size:.2f} TiB"


def _model_arg(plan: Plan) -> str:
    model = plan.request.model
    if model.source == "preset":
        from .models import MODEL_PRESETS

        return MODEL_PRESETS[model.name].get("hf_name", model.name)
    if model.source == "generic":
        return "<model>"
    return str(model.source).removesuffix("/config.json").removesuffix("config.json") or "."


def recommended_flags(plan: Plan) -> list[str]:
    """The serve flags the plan recommends (shared by `pagedserve serve` and `vllm serve`)."""
    req = plan.request
    flags = []
    if req.tensor_parallel_size > 1:
        flags += ["--tensor-parallel-size", str(req.tensor_parallel_size)]
    if req.pipeline_parallel_size > 1:
        flags += ["--pipeline-parallel-size", str(req.pipeline_parallel_size)]
    if req.data_parallel_size > 1:
        flags += ["--data-parallel-size", str(req.data_parallel_size)]
    if plan.layout.expert_parallel:
        flags += ["--enable-expert-parallel"]
    if req.dtype and req.dtype not in ("fp8", "int4"):
        flags += ["--dtype", req.dtype]
    if req.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", req.kv_cache_dtype]
    if req.kv_cache_memory is not None:
        flags += ["--kv-cache-memory", str(req.kv_cache_memory)]
    else:
        flags += ["--gpu-memory-utilization", f"{req.gpu_memory_utilization:g}"]
    max_model_len = min(plan.max_model_len, plan.largest_max_model_len) or plan.max_model_len
    flags += [
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max(plan.recommended_max_num_seqs, 1)),
        "--max-num-batched-tokens", str(plan.recommended_max_num_batched_tokens),
        "--block-size", str(req.block_size),
    ]
    return flags


def serve_commands(plan: Plan) -> dict[str, str]:
    flags = recommended_flags(plan)
    model = shlex.quote(_model_arg(plan))
    ours = ["pagedserve", "serve", model] + (["--device", "cpu"] if plan.request.device_kind == "cpu" else []) + flags
    vllm = ["vllm", "serve", model] + flags
    if plan.request.device_kind == "cpu" and plan.request.kv_cache_memory is not None:
        # vLLM's CPU backend takes the pool size (whole GiB) from an environment variable.
        i = vllm.index("--kv-cache-memory")
        del vllm[i:i + 2]
        vllm.insert(0, f"VLLM_CPU_KVCACHE_SPACE={max(1, plan.request.kv_cache_memory // 2**30)}")
    return {"pagedserve": " ".join(ours), "vllm": " ".join(vllm)}


def num_host_blocks_of(plan: Plan) -> int:
    """Host swap blocks per rank, as the engine cuts --swap-space (core.engine_core.num_host_blocks_for)."""
    bytes_per_block = plan.pool.bytes_per_block
    return plan.request.swap_space // bytes_per_block if bytes_per_block else 0


def num_tier_blocks_of(plan: Plan) -> int:
    """Host KV tier blocks per rank, as the engine cuts --kv-offloading-size (core.engine_core.num_tier_blocks_for)."""
    req, bytes_per_block = plan.request, plan.pool.bytes_per_block
    if not req.kv_offloading_size or not bytes_per_block:
        return 0
    world = req.tensor_parallel_size * req.pipeline_parallel_size
    return int(req.kv_offloading_size * 2**30 // (bytes_per_block * world))


def plan_to_dict(plan: Plan) -> dict:
    req, shape = plan.request, plan.request.model.shape
    total = req.device.memory_bytes
    return {
        "model": {
            "name": req.model.name, "source": req.model.source, "num_params": plan.num_params,
            "weight_dtype": plan.weight_dtype, "weight_bytes_total": plan.weight_bytes_total,
            "num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
            "is_mla": shape.is_mla, "is_moe": shape.is_moe, "vocab_size": shape.vocab_size,
        },
        "device": {**req.device.to_dict(), "kind": req.device_kind},
        "inputs": {
            "tensor_parallel_size": req.tensor_parallel_size,
            "pipeline_parallel_size": req.pipeline_parallel_size,
            "data_parallel_size": req.data_parallel_size,
            "expert_parallel_size": plan.layout.ep,
            "gpu_memory_utilization": req.gpu_memory_utilization,
            "kv_cache_memory": req.kv_cache_memory, "kv_cache_dtype": plan.kv_dtype,
            "block_size": req.block_size, "max_model_len": plan.max_model_len,
            "mean_seq_len": plan.mean_seq_len, "max_num_seqs": plan.max_num_seqs_used,
            "max_num_batched_tokens": plan.max_num_batched_tokens_used, "margin": req.margin,
        },
        "memory_per_gpu": [
            {"part": p.name, "bytes": p.bytes, "fraction": p.bytes / total if total else None, "note": p.note}
            for p in plan.parts
        ],
        "kv": {
            "bytes_per_token_per_gpu": plan.kv_bytes_per_token,
            "bytes_per_token_all_gpus": plan.kv_bytes_per_token_all_ranks,
            "replication": plan.kv_replication,
            "pool_budget_bytes": plan.kv_pool_budget_bytes,
            "num_blocks": plan.pool.num_blocks,
            "bytes_per_block": plan.pool.bytes_per_block,
            "num_tokens": plan.pool.num_tokens,
            "swap_space_bytes": req.swap_space,
            "num_host_blocks": num_host_blocks_of(plan),
            # pinned on CUDA (all resident); on CPU resident only up to the most blocks swapped at once
            "swap_space_resident_at_start": (num_host_blocks_of(plan) * plan.pool.bytes_per_block
                                             if req.device_kind == "gpu" else 0),
            "kv_offloading_size_gib": req.kv_offloading_size,
            "host_tier_blocks": num_tier_blocks_of(plan),
            "host_tier_tokens": num_tier_blocks_of(plan) * req.block_size,
        },
        "derived": {
            "max_concurrency_at_max_model_len": plan.max_concurrency_at_max_model_len,
            "concurrency_at_mean_seq_len": plan.concurrency_at_mean,
            "largest_max_model_len": plan.largest_max_model_len,
        },
        "recommended": {
            "max_num_seqs": plan.recommended_max_num_seqs,
            "max_num_batched_tokens": plan.recommended_max_num_batched_tokens,
            "flags": recommended_flags(plan),
            "commands": serve_commands(plan),
        },
        "parallel": {
            "layout": plan.layout.describe(), "num_gpus": plan.layout.num_gpus, "binding_stage": plan.binding_stage,
            "fits": plan.fits,
            "stages": [{"stage": st.stage, "first_layer": st.first_layer, "num_layers": st.num_layers,
                        "weight_bytes_per_gpu": st.weight_bytes, "kv_bytes_per_token_per_gpu": st.kv_bytes_per_token,
                        "routed_experts_per_gpu": st.routed_experts_per_gpu, "params_per_gpu": st.params}
                       for st in plan.stages],
        },
        "warnings": plan.warnings,
    }


def render_text(plan: Plan) -> str:
    req = plan.request
    total = req.device.memory_bytes
    device = "CPU" if req.device_kind == "cpu" else "GPU"
    lines = [
        f"pagedserve plan: {req.model.name} ({plan.num_params / 1e9:.2f}B params, weights {plan.weight_dtype}, "
        f"KV {plan.kv_dtype}) on {plan.layout.num_gpus} x {req.device.name} ({plan.layout.describe()})"
        + (f" ({format_bytes(total)} each)" if total else ""),
        "",
        f"Where the memory goes, per {device}:",
    ]
    name_w = max(len(p.name) for p in plan.parts)
    lines.append(f"  {'part':<{name_w}}  {'bytes':>16}  {'size':>11}  {'share':>6}  note")
    for p in plan.parts:
        share = f"{100 * p.bytes / total:5.1f}%" if total else "     -"
        lines.append(f"  {p.name:<{name_w}}  {p.bytes:>16,}  {format_bytes(p.bytes):>11}  {share:>6}  {p.note}")
    if total:
        lines.append(f"  {'total':<{name_w}}  {total:>16,}  {format_bytes(total):>11}  100.0%")
    else:
        needed = sum(p.bytes for p in plan.parts)
        lines.append(f"  {'needed':<{name_w}}  {needed:>16,}  {format_bytes(needed):>11}       -  "
                     "device total unknown (give --memory)")
    lines += [
        "",
        "KV cache:",
        f"  per token per {device:<4}    {plan.kv_bytes_per_token:,} bytes ({format_bytes(plan.kv_bytes_per_token)}; "
        f"{kv_heads_note(plan)})",
        f"  per token, all ranks   {plan.kv_bytes_per_token_all_ranks:,} bytes "
        f"({format_bytes(plan.kv_bytes_per_token_all_ranks)}; replication x{plan.kv_replication:g})",
        f"  pool                   {plan.pool.num_blocks:,} blocks x {req.block_size} tokens = "
        f"{plan.pool.num_tokens:,} tokens",
    ]
    lines += [f"  {line}" for line in kv_cache_log_lines(plan.pool, plan.max_model_len, device, kv_dtype=plan.kv_dtype)]
    num_host_blocks = num_host_blocks_of(plan)
    if num_host_blocks:
        lines.append("  " + swap_space_line(num_host_blocks, plan.pool.bytes_per_block,
                                            "cuda" if req.device_kind == "gpu" else "cpu", req.tensor_parallel_size))
    num_tier_blocks = num_tier_blocks_of(plan)
    if num_tier_blocks:
        ratio = num_tier_blocks / plan.pool.num_blocks if plan.pool.num_blocks else 0.0
        lines.append(f"  host KV tier           {num_tier_blocks:,} blocks per rank = {num_tier_blocks * req.block_size:,} "
                     f"prefix tokens ({ratio:.1f}x the pool) kept after the pool evicts them "
                     f"(--kv-offloading-size {req.kv_offloading_size:g} GiB over all ranks)")
    if len(plan.stages) > 1:
        lines += ["", "Pipeline stages (per GPU; every stage holds the same blocks, the tightest sets them):"]
        for st in plan.stages:
            mark = "  <- sets the pool" if st.stage == plan.binding_stage else ""
            lines.append(f"  stage {st.stage}: layers {st.first_layer}-{st.first_layer + st.num_layers - 1}, "
                         f"weights {format_bytes(st.weight_bytes)}, KV {st.kv_bytes_per_token:,} bytes/token{mark}")
    lines += [
        "",
        "Derived:",
        f"  worst case (every request at max_model_len={plan.max_model_len:,}): "
        f"{plan.max_concurrency_at_max_model_len:.2f} concurrent requests",
        f"  at the mean sequence length {plan.mean_seq_len:,}: {plan.concurrency_at_mean:.1f} concurrent sequences",
        f"  recommended max_num_seqs = {1 - req.margin:.0%} of that = {plan.recommended_max_num_seqs}",
        f"  recommended max_num_batched_tokens = {plan.recommended_max_num_batched_tokens:,}",
        f"  largest max_model_len one request can have: {plan.largest_max_model_len:,}",
        "",
        "Recommended:",
    ]
    commands = serve_commands(plan)
    lines += [f"  {commands['pagedserve']}", f"  {commands['vllm']}"]
    if plan.warnings:
        lines += ["", "Warnings:"] + [f"  - {w}" for w in plan.warnings]
    return "\n".join(lines)
