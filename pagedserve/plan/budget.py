"""The per-GPU memory budget: where memory goes, how many KV blocks fit, which knobs follow.

    KV pool per GPU = total x gpu_memory_utilization
                      - weights on this GPU (plan/parallel.py: TP, PP, DP, EP)
                      - activation peak at max_num_batched_tokens
                      - sampler / logits buffer
                      - non-torch + CUDA-graph overhead

or, when `kv_cache_memory` is given (always on CPU), exactly that many bytes. The pool
is then cut into whole blocks by `kv_budget.size_kv_pool`, the same call the engine
makes at start-up, so a plan and a start-up agree to the block.

Under pipeline parallelism every stage holds the same number of blocks (a token's KV
lives on every stage), so the stage with the least room per block sets the pool, as
vLLM takes the minimum over its workers; that stage's memory is what `parts` shows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pagedserve.config import KV_CACHE_DTYPES, resolve_dtype, resolve_kv_cache_dtype

from .gpus import GiB, GpuSpec
from .kv_budget import (
    KVPoolSize,
    blocks_per_request,
    dtype_bytes,
    kv_heads_per_rank,
    kv_bytes_per_token,
    kv_replication,
    kv_replication_warning,
    max_concurrency,
    size_kv_pool_for_dtype,
)
from .models import ModelInfo, param_count, weight_bytes
from .parallel import ParallelLayout, StageWeights, stage_shape, stage_weights

# The sampler keeps three fp32 [max_num_seqs, vocab] tensors alive at its peak: the
# logits, the probabilities and the log-probabilities (vLLM's profile run samples a
# dummy batch of max_num_seqs for the same reason). The formula counts one;
# three is what the sampler actually holds.
SAMPLER_FP32_COPIES = 3

# Non-torch memory (CUDA context, cuBLAS workspaces, NCCL buffers) plus CUDA graphs.
# vLLM measured 1.79 GiB non-torch on Llama-3-8B / H100 at TP 1 and 3.58 GiB at TP 2
# (vllm-project/vllm PR #10511: NCCL buffers grow with TP); rounded up for graphs.
DEFAULT_GPU_OVERHEAD_TP1 = 2 * GiB
DEFAULT_GPU_OVERHEAD_TP_N = 4 * GiB


def default_overhead_bytes(device: str, tp: int) -> int:
    """The stated default for `--overhead`: 0 on CPU, 2 GiB on one GPU, 4 GiB per GPU under TP."""
    if device == "cpu":
        return 0
    return DEFAULT_GPU_OVERHEAD_TP1 if tp == 1 else DEFAULT_GPU_OVERHEAD_TP_N


# vLLM's defaults by device and usage context, when the user sets neither knob:
# vllm/engine/arg_utils.py, EngineArgs._set_default_args (v0.10-0.11 onwards; read at
# vllm-project/vllm 99d7eb5). A GPU reporting >= 70 GiB whose name does not contain "a100"
# (H100, H200, MI300X, B200, ...) gets 8192 tokens / 1024 seqs for the OpenAI API server and
# 16384 / 1024 for the offline LLM class; every other GPU (A100 of any size -- "setting large
# max_num_batched_tokens for A100 reduces throughput", vLLM PR #17885 -- L4, L40S, RTX-4090,
# 40 GB parts) 2048 / 256 for the server, 8192 / 256 for LLM. max_num_seqs is then capped at
# max_num_batched_tokens. (A prompt is taken whole, max_num_batched_tokens = max_model_len, when
# chunked prefill is off.) The name test is vLLM's: the device name lowercased.
USAGE_CONTEXTS = ("server", "offline")  # vLLM's UsageContext.OPENAI_API_SERVER / LLM_CLASS


def vllm_batch_defaults(device_memory_bytes: int, device_name: str = "", usage: str = "server",
                        max_num_batched_tokens: int | None = None) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM picks on this GPU for `usage` (see above);
    max_num_seqs capped at the token budget in use (`max_num_batched_tokens` when the user gave
    it, else the default). The one place `plan`, `simulate` and `tune` take these defaults from."""
    if usage not in USAGE_CONTEXTS:
        raise ValueError(f"usage: must be one of {', '.join(USAGE_CONTEXTS)}, got {usage!r}")
    if device_memory_bytes >= 70 * GiB and "a100" not in device_name.lower():
        tokens, seqs = (8192, 1024) if usage == "server" else (16384, 1024)
    else:
        tokens, seqs = (2048, 256) if usage == "server" else (8192, 256)
    return tokens, min(seqs, max_num_batched_tokens or tokens)


def default_max_num_batched_tokens(device_memory_bytes: int, device_name: str = "", usage: str = "server") -> int:
    """vLLM's max_num_batched_tokens on this GPU (vllm_batch_defaults)."""
    return vllm_batch_defaults(device_memory_bytes, device_name, usage)[0]


def activation_dtype(weight_dtype: str) -> str:
    """Quantized weights still compute in bf16; 16- and 32-bit models compute in their own dtype."""
    if dtype_bytes(weight_dtype) == 4:
        return "float32"
    return "float16" if weight_dtype in ("float16", "fp16", "half") else "bfloat16"


def activation_peak_bytes(model: ModelInfo, max_num_batched_tokens: int, tp: int, act_dtype: str) -> int:
    """Estimated activation peak of one forward pass over `max_num_batched_tokens` tokens.

    peak = max_num_batched_tokens x act_bytes x (3 x hidden + max(ffn, attn) / tp)

    - 3 x hidden: the residual stream, the normed input and the layer's output, live
      together across a decoder layer (replicated on every TP rank);
    - ffn = 3 x intermediate for a SwiGLU MLP: the fused gate|up output (2 x I) and the
      activated product (I); for MoE, 3 x (top_k x moe_intermediate + shared width)
      since each token visits top_k experts;
    - attn = q + k + v + attention output widths (for MLA: the per-head q, k and v).

    Only one layer's temporaries are alive at once (inference keeps no activations
    for backward). Logits are not here: they are the sampler buffer. This is an
    estimate; pass `--activation-memory` with a measured figure to override it.
    """
    s = model.shape
    h = s.hidden_size
    ffn = 3 * s.intermediate_size
    if s.is_moe:
        moe_ffn = 3 * (s.num_experts_per_tok * s.moe_intermediate_size + s.shared_expert_intermediate_size)
        ffn = max(moe_ffn, ffn if s.first_dense_layers else 0)
    if s.is_mla:
        nope, rope = s.qk_nope_head_dim or 0, s.qk_rope_head_dim or 0
        v_dim = s.v_head_dim or s.head_dim
        attn = s.num_attention_heads * (2 * (nope + rope) + 2 * v_dim)
    else:
        attn = (2 * s.num_attention_heads + 2 * s.num_kv_heads) * s.head_dim
    per_token = 3 * h + max(ffn, attn) / tp
    return int(max_num_batched_tokens * per_token * dtype_bytes(act_dtype))


def sampler_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """Sampler / logits buffer: max_num_seqs x vocab x 4 bytes (fp32) x SAMPLER_FP32_COPIES.

    Logits are gathered to full vocab width on the sampling rank, so TP does not shrink it.
    """
    return max_num_seqs * vocab_size * 4 * SAMPLER_FP32_COPIES


@dataclass
class PlanRequest:
    """Everything `plan` is asked. None means "use the stated default"."""

    model: ModelInfo
    device: GpuSpec
    device_kind: str = "gpu"  # "gpu" or "cpu"
    dtype: str | None = None  # weights; None = the checkpoint's dtype
    kv_cache_dtype: str = "auto"  # "auto" = activation dtype
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    expert_parallel_size: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    mean_seq_len: int | None = None
    margin: float = 0.2
    overhead: int | None = None
    activation_memory: int | None = None
    sampler_memory: int | None = None
    swap_space: int = 4 << 30  # host memory per rank for swapped blocks, as `serve --swap-space`; 0 = none
    kv_offloading_size: float | None = None  # GiB over all ranks for the host KV tier, as `serve --kv-offloading-size`


@dataclass
class MemoryPart:
    name: str
    bytes: int
    note: str = ""


@dataclass
class Plan:
    request: PlanRequest
    weight_dtype: str
    kv_dtype: str
    num_params: int
    weight_bytes_total: int
    parts: list[MemoryPart]  # per GPU, sums to the device total (headroom is the rest)
    pool: KVPoolSize
    kv_pool_budget_bytes: int
    kv_bytes_per_token_all_ranks: int
    kv_replication: float
    max_model_len: int
    mean_seq_len: int
    max_num_seqs_used: int
    max_num_batched_tokens_used: int
    max_concurrency_at_max_model_len: float
    concurrency_at_mean: float
    recommended_max_num_seqs: int
    recommended_max_num_batched_tokens: int
    largest_max_model_len: int
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    stages: list[StageWeights] = field(default_factory=list)
    binding_stage: int = 0          # the stage whose memory sets the pool (and `parts`)
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Weights and the rest leave a pool that holds one max_model_len request."""
        return self.pool.num_tokens >= self.max_model_len > 0

    @property
    def kv_bytes_per_token(self) -> int:
        return self.pool.bytes_per_token


def _resolve_kv_dtype(kv_cache_dtype: str, weight_dtype: str) -> str:
    """What the pool stores, as the engine resolves it (auto = the activation dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return resolve_kv_cache_dtype(kv_cache_dtype, activation_dtype(weight_dtype))


def _validate(req: PlanRequest) -> None:
    tp = req.tensor_parallel_size
    checks = [
        (tp >= 1, f"--tensor-parallel-size must be >= 1, got {tp}"),
        (0 < req.gpu_memory_utilization <= 1, f"--gpu-memory-utilization must be in (0, 1], got {req.gpu_memory_utilization}"),
        (req.block_size >= 1, f"--block-size must be >= 1, got {req.block_size}"),
        (0 <= req.margin < 1, f"--margin must be in [0, 1), got {req.margin}"),
        (req.max_model_len is None or req.max_model_len >= 1, f"--max-model-len must be >= 1, got {req.max_model_len}"),
        (req.max_num_seqs is None or req.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {req.max_num_seqs}"),
        (req.max_num_batched_tokens is None or req.max_num_batched_tokens >= 1,
         f"--max-num-batched-tokens must be >= 1, got {req.max_num_batched_tokens}"),
        (req.mean_seq_len is None or req.mean_seq_len >= 1, f"--mean-seq-len must be >= 1, got {req.mean_seq_len}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    layout = layout_of(req)  # raises naming the flag
    if layout.expert_parallel and not req.model.shape.is_moe:
        raise ValueError(f"--enable-expert-parallel: {req.model.name} has no experts to spread")
    if layout.pp > req.model.shape.num_layers:
        raise ValueError(f"--pipeline-parallel-size {layout.pp} is more than the model's "
                         f"{req.model.shape.num_layers} layers")
    if req.device_kind == "cpu" and req.kv_cache_memory is None and req.device.memory_bytes <= 0:
        raise ValueError("--device cpu needs --kv-cache-memory (the pool's byte budget) or --memory")


def _default_max_model_len(req: PlanRequest) -> int:
    return req.max_model_len or req.model.shape.max_position_embeddings or 8192


def layout_of(req: PlanRequest) -> ParallelLayout:
    return ParallelLayout(req.tensor_parallel_size, req.pipeline_parallel_size, req.data_parallel_size,
                          req.enable_expert_parallel, req.expert_parallel_size)


def compute_plan(req: PlanRequest) -> Plan:
    """Work out the budget. If the token budget must grow to cover max_num_seqs
    (a step must be able to decode every running sequence), the activation peak is
    recomputed at the larger budget so the plan stays consistent."""
    _validate(req)
    device_tokens = (req.max_num_batched_tokens
                     or default_max_num_batched_tokens(req.device.memory_bytes, req.device.name))
    plan = _compute(req, device_tokens)
    if req.max_num_batched_tokens is None and plan.recommended_max_num_batched_tokens > device_tokens:
        plan = _compute(req, plan.recommended_max_num_batched_tokens)
    return plan


def _weight_dtype(req: PlanRequest) -> str:
    """The dtype the engine would compute in. On CPU the engine's own rule decides (a bf16
    checkpoint under dtype auto computes, and sizes its KV pool, in fp32)."""
    if req.device_kind == "cpu" and (req.dtype or "auto") in ("auto", "float32", "bfloat16", "float16"):
        return resolve_dtype(req.dtype or "auto", req.model.checkpoint_dtype, "cpu")
    return req.dtype or req.model.checkpoint_dtype


def _compute(req: PlanRequest, max_num_batched_tokens: int) -> Plan:
    model, shape, tp = req.model, req.model.shape, req.tensor_parallel_size
    weight_dtype = _weight_dtype(req)
    kv_dtype = _resolve_kv_dtype(req.kv_cache_dtype, weight_dtype)
    total = req.device.memory_bytes
    max_model_len = _default_max_model_len(req)
    mean_seq_len = req.mean_seq_len or min(2048, max_model_len)
    # vLLM's default for the device unless given: it sizes the sampler buffer (vLLM's profile run
    # samples max_num_seqs rows)
    max_num_seqs = req.max_num_seqs or vllm_batch_defaults(total, req.device.name,
                                                           max_num_batched_tokens=req.max_num_batched_tokens)[1]

    weights_total = weight_bytes(shape, weight_dtype)
    layout = layout_of(req)
    act_note = "given" if req.activation_memory is not None else f"estimated at {max_num_batched_tokens:,} batched tokens"
    activation = req.activation_memory if req.activation_memory is not None else activation_peak_bytes(
        model, max_num_batched_tokens, tp, activation_dtype(weight_dtype))
    sampler = req.sampler_memory if req.sampler_memory is not None else sampler_bytes(max_num_seqs, shape.vocab_size)
    overhead = req.overhead if req.overhead is not None else default_overhead_bytes(req.device_kind, tp)

    usable = int(total * req.gpu_memory_utilization)
    stages = stage_weights(shape, weight_dtype, layout, kv_dtype)
    sized = []
    for stage in stages:
        if req.kv_cache_memory is not None:
            budget = req.kv_cache_memory
        else:
            budget = usable - stage.weight_bytes - activation - sampler - overhead
        sized.append((size_kv_pool_for_dtype(stage_shape(shape, stage), max(budget, 0), kv_dtype,
                                             block_size=req.block_size, tp=tp), budget, stage))
    # the stage with the fewest blocks sets the pool; among equals, the one with least room left
    pool, pool_budget, binding = min(sized, key=lambda s: (s[0].num_blocks, s[1]))
    weights = binding.weight_bytes
    pool_note = ("given by --kv-cache-memory" if req.kv_cache_memory is not None
                 else f"total x {req.gpu_memory_utilization:g} minus the rows above")
    where = (f"stage {binding.stage} of {layout.pp} (layers {binding.first_layer}-"
             f"{binding.first_layer + binding.num_layers - 1}), " if layout.pp > 1 else "")
    experts = (f", {binding.routed_experts_per_gpu} whole experts per MoE layer (EP {layout.ep})"
               if shape.is_moe and layout.ep > 1 else "")

    parts = [
        MemoryPart("model weights", weights, f"{param_count(shape) / 1e9:.2f}B params, {weight_dtype}, "
                   f"{where}{layout.describe()}{experts}"),
        MemoryPart("activation peak", activation, act_note),
        MemoryPart("sampler / logits", sampler, f"{max_num_seqs} seqs x {shape.vocab_size:,} vocab x fp32 x {SAMPLER_FP32_COPIES}"
                   if req.sampler_memory is None else "given"),
        MemoryPart("non-torch + CUDA graphs", overhead, "given" if req.overhead is not None else "stated default"),
        MemoryPart("KV cache pool", max(pool_budget, 0), pool_note),
    ]
    if req.device_kind == "cpu":
        parts[3].name = "runtime overhead"
    used = sum(p.bytes for p in parts)
    if total > 0:  # a CPU plan given only --kv-cache-memory has no known total
        parts.append(MemoryPart("headroom (not used)", total - used,
                                f"1 - gpu_memory_utilization ({1 - req.gpu_memory_utilization:.2f})"
                                if req.kv_cache_memory is None else "total minus the rows above"))

    num_tokens = pool.num_tokens
    concurrency_max = max_concurrency(pool.num_blocks, req.block_size, max_model_len)
    concurrency_mean = pool.num_blocks / blocks_per_request(mean_seq_len, req.block_size)
    recommended_seqs = int((1 - req.margin) * concurrency_mean)
    seqs_for_tokens = req.max_num_seqs or max(recommended_seqs, 1)
    recommended_tokens = max(max_num_batched_tokens, _round_up(seqs_for_tokens, 256))

    plan = Plan(
        request=req, weight_dtype=weight_dtype, kv_dtype=kv_dtype, num_params=param_count(shape),
        weight_bytes_total=weights_total, parts=parts, pool=pool, kv_pool_budget_bytes=pool_budget,
        kv_bytes_per_token_all_ranks=kv_bytes_per_token(shape, dtype_bytes(kv_dtype), tp) * tp,
        kv_replication=kv_replication(shape, tp),
        max_model_len=max_model_len, mean_seq_len=mean_seq_len, max_num_seqs_used=max_num_seqs,
        max_num_batched_tokens_used=max_num_batched_tokens,
        max_concurrency_at_max_model_len=concurrency_max, concurrency_at_mean=concurrency_mean,
        recommended_max_num_seqs=recommended_seqs, recommended_max_num_batched_tokens=recommended_tokens,
        largest_max_model_len=num_tokens, layout=layout, stages=stages, binding_stage=binding.stage,
    )
    plan.warnings = _warnings(plan, usable, total, weights + activation + sampler + overhead)
    return plan


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def _warnings(plan: Plan, usable: int, total: int, non_kv: int) -> list[str]:
    req, shape, tp = plan.request, plan.request.model.shape, plan.request.tensor_parallel_size
    out: list[str] = []
    if req.kv_cache_memory is None and plan.kv_pool_budget_bytes <= 0:
        out.append(
            f"gpu_memory_utilization {req.gpu_memory_utilization:g} leaves no room for the KV cache: weights, "
            f"activations and overhead need {_gib(non_kv)} per GPU but only {_gib(usable)} is allowed. "
            "Raise --gpu-memory-utilization, lower --max-num-batched-tokens, quantize (--dtype fp8), or add GPUs (-tp)."
        )
    elif plan.pool.num_tokens < plan.max_model_len:
        out.append(
            f"the KV pool holds {plan.pool.num_tokens:,} tokens, fewer than one max_model_len={plan.max_model_len:,} "
            f"request; vLLM would refuse to start. Use --max-model-len {plan.largest_max_model_len} or less, "
            "or give the pool more memory (higher utilisation, --kv-cache-dtype fp8, more GPUs)."
        )
    if req.kv_cache_memory is not None and total > 0 and non_kv + req.kv_cache_memory > total:
        out.append(
            f"--kv-cache-memory {_gib(req.kv_cache_memory)} plus weights, activations and overhead "
            f"({_gib(non_kv)}) exceed the device's {_gib(total)}: start-up would run out of memory."
        )
    if 0 < plan.kv_pool_budget_bytes < plan.parts[1].bytes:
        out.append(
            f"the activation peak ({_gib(plan.parts[1].bytes)}) is larger than the KV pool; "
            "a smaller --max-num-batched-tokens would give the pool more room."
        )
    out += _expert_warnings(plan)
    if shape.is_mla and tp > 1:
        out.append(
            f"MLA keeps the whole latent KV on every rank: TP {tp} does not shrink the KV per token "
            f"({plan.kv_bytes_per_token:,} bytes on each of the {tp} ranks)."
        )
    elif (replicated := kv_replication_warning(shape, tp)) is not None:
        out.append(replicated)
    if not shape.is_mla and tp > 1 and shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        out.append(f"{shape.num_kv_heads} KV heads cannot be split evenly over TP {tp}; vLLM will refuse this TP size.")
    if shape.num_attention_heads % tp:
        out.append(f"{shape.num_attention_heads} attention heads are not divisible by TP {tp}; vLLM will refuse this TP size.")
    if req.max_num_seqs is not None and plan.pool.num_blocks and req.max_num_seqs > plan.concurrency_at_mean:
        out.append(
            f"--max-num-seqs {req.max_num_seqs} is more than the {plan.concurrency_at_mean:.0f} sequences of "
            f"{plan.mean_seq_len:,} tokens the pool holds: expect preemption once they grow."
        )
    if plan.pool.num_blocks and plan.recommended_max_num_seqs < 1:
        out.append(f"the pool holds less than one {plan.mean_seq_len:,}-token sequence after the "
                   f"{req.margin:.0%} margin.")
    return out


def _expert_bytes_per_gpu(plan: Plan, layout: ParallelLayout) -> int:
    """Routed-expert bytes on the binding stage's GPUs under `layout`."""
    shape = plan.request.model.shape
    stage = plan.stages[plan.binding_stage]
    moe_layers = sum(1 for i in range(stage.first_layer, stage.first_layer + stage.num_layers)
                     if i >= shape.first_dense_layers)
    per_expert = 3 * shape.hidden_size * shape.moe_intermediate_size * dtype_bytes(plan.weight_dtype)
    if layout.ep > 1:
        return int(moe_layers * math.ceil(shape.num_experts / layout.ep) * per_expert)
    return int(moe_layers * shape.num_experts * per_expert / layout.tp)


def _expert_warnings(plan: Plan) -> list[str]:
    """The articles' symptom "OOM: EP not enabled, experts pile onto every GPU", and uneven EP."""
    req, shape, layout = plan.request, plan.request.model.shape, plan.layout
    if not shape.is_moe:
        return []
    out = []
    if layout.expert_parallel and shape.num_experts % layout.ep:
        out.append(f"{shape.num_experts} experts do not split evenly over EP {layout.ep}: some GPUs hold "
                   f"{math.ceil(shape.num_experts / layout.ep)} experts per layer, others fewer.")
    if layout.expert_parallel or req.kv_cache_memory is not None or plan.kv_pool_budget_bytes > 0:
        return out
    now = _expert_bytes_per_gpu(plan, layout)
    if layout.dp > 1:
        with_ep = _expert_bytes_per_gpu(plan, replace(layout, enable_expert_parallel=True))
        out.append(
            f"the experts do not fit: expert parallelism is off, so each of the {layout.dp} data-parallel replicas "
            f"holds all {shape.num_experts} experts per layer ({_gib(now)} of expert weights per GPU). "
            f"--enable-expert-parallel spreads whole experts over TP x DP = {layout.tp * layout.dp} GPUs "
            f"({_gib(with_ep)} per GPU).")
    else:
        out.append(
            f"the experts do not fit ({_gib(now)} of expert weights per GPU at TP {layout.tp}). With one data-parallel "
            "replica, expert parallelism moves no memory (1/TP of every expert or 1/TP of the experts is the same "
            "bytes): add GPUs (-tp, -pp, or -dp with --enable-expert-parallel) or quantize (--dtype fp8).")
    return out


def kv_heads_note(plan: Plan) -> str:
    shape, tp = plan.request.model.shape, plan.request.tensor_parallel_size
    if shape.is_mla:
        return f"MLA latent {shape.kv_lora_rank}+{shape.qk_rope_head_dim} per layer, full copy on each rank"
    return f"{kv_heads_per_rank(shape, tp)} of {shape.num_kv_heads} KV heads per rank"
