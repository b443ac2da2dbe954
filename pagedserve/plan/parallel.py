"""Parallel layouts: what one GPU holds under tensor (TP), pipeline (PP), data (DP) and
expert (EP) parallelism. Torch-free; `plan` and `simulate` both read it.

GPUs = TP x PP x DP, laid out as vLLM lays them out:

- PP splits the decoder layers into contiguous stages: an even split with the remainder
  given to the stages just before the last one (vLLM's `get_pp_indices`; the last stage
  also carries the final norm and the LM head). Stage 0 holds the embedding.
- Within a stage, TP shards the attention heads (q/kv/o projections), dense MLPs, shared
  experts, the embedding and the LM head (vocab-parallel). Every TP rank keeps a whole copy
  of the norms, the MoE router (with Qwen2-MoE's shared-expert gate and DeepSeek-V3's
  correction bias) and MLA's down-projections q_a_proj / kv_a_proj_with_mqa
  (vLLM and SGLang build those as ReplicatedLinear).
- Routed experts: without EP each expert is TP-sharded like a dense MLP, and every DP rank
  holds all of them. With EP (vLLM's --enable-expert-parallel: EP size = TP x DP) whole
  experts are spread over the stage's TP x DP GPUs, ceil(E / EP) each. With DP = 1 this
  moves no memory (1/TP of every expert or every TP-th expert is the same bytes); it is
  DP (attention replicated, as DeepSeek's own deployment runs) where EP decides whether
  the experts fit.
- KV per token on one GPU: only its stage's layers; GQA heads split by TP (a head is
  replicated when TP exceeds the KV heads); the MLA latent is whole on every TP rank.

Invariant: with TP = PP = DP = 1, `stage_weights(...)[0].weight_bytes` equals
`models.weight_bytes(shape, dtype)`, and the stages' KV bytes per token sum to the
whole model's.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from .kv_budget import ModelShape, dtype_bytes, kv_bytes_per_token, kv_heads_per_rank


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    expert_parallel_size: int | None = None  # given: must be TP x DP (vLLM's EP group)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        ep = self.expert_parallel_size
        if ep is not None and ep != self.tensor_parallel_size * self.data_parallel_size:
            raise ValueError(
                f"--expert-parallel-size {ep}: the expert-parallel group is the TP x DP GPUs of a pipeline stage "
                f"(vLLM's layout), here {self.tensor_parallel_size} x {self.data_parallel_size} = "
                f"{self.tensor_parallel_size * self.data_parallel_size}")

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_parallel_size

    @property
    def dp(self) -> int:
        return self.data_parallel_size

    @property
    def expert_parallel(self) -> bool:
        return self.enable_expert_parallel or self.expert_parallel_size is not None

    @property
    def ep(self) -> int:
        """GPUs the routed experts are spread over (1: every GPU holds a share of each)."""
        return self.tp * self.dp if self.expert_parallel else 1

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        parts = [f"TP{self.tp}"] + [f"PP{self.pp}"] * (self.pp > 1) + [f"DP{self.dp}"] * (self.dp > 1)
        text = "x".join(parts)
        return text + (f"+EP{self.ep}" if self.expert_parallel else "")


_LAYOUT_PART = re.compile(r"^(TP|PP|DP|EP)(\d+)$")


def parse_layout(text: str) -> ParallelLayout:
    """"TP8", "TP8+EP8", "TP4xPP2", "DP8+EP8" (case-insensitive) -> ParallelLayout. EP, if
    given, must be TP x DP (vLLM's expert-parallel group)."""
    sizes = {"TP": 1, "PP": 1, "DP": 1}
    ep = None
    for part in re.split(r"[X*+,]", text.strip().upper()):
        m = _LAYOUT_PART.match(part.strip())
        if m is None:
            raise ValueError(f"layout {text!r}: expected parts like TP8, PP2, DP2, EP8 joined by x or +")
        if m.group(1) == "EP":
            ep = int(m.group(2))
        else:
            sizes[m.group(1)] = int(m.group(2))
    layout = ParallelLayout(sizes["TP"], sizes["PP"], sizes["DP"], enable_expert_parallel=ep is not None and ep > 1,
                            expert_parallel_size=ep if ep is not None and ep > 1 else None)
    return layout


def stage_layer_counts(num_layers: int, pp: int) -> list[int]:
    """Decoder layers of each pipeline stage (vLLM's partition)."""
    if pp > num_layers:
        raise ValueError(f"--pipeline-parallel-size {pp} is more than the model's {num_layers} layers")
    counts = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        counts[-2 - i] += 1
    return counts


@dataclass(frozen=True)
class StageWeights:
    """One GPU of one pipeline stage: its layers, its parameters by part, its bytes."""

    stage: int
    first_layer: int
    num_layers: int
    params: dict[str, int]       # per GPU, by part (as models.param_breakdown names them)
    routed_experts_per_gpu: int  # whole experts held per MoE layer (EP), or E with a 1/TP share each
    weight_bytes: int
    kv_bytes_per_token: int


def _layer_params(shape: ModelShape, sparse: bool, tp: int, ep: int) -> dict[str, float]:
    """Parameters one GPU holds of one decoder layer, by part."""
    h = shape.hidden_size
    if shape.is_mla:
        nope, rope = shape.qk_nope_head_dim or 0, shape.qk_rope_head_dim or 0
        v_dim = shape.v_head_dim or shape.head_dim
        q_width = shape.num_attention_heads * (nope + rope)
        if shape.q_lora_rank:
            replicated = h * shape.q_lora_rank + shape.q_lora_rank
            sharded = shape.q_lora_rank * q_width
        else:
            replicated, sharded = 0, h * q_width
        replicated += h * (shape.kv_lora_rank + rope) + shape.kv_lora_rank
        sharded += shape.kv_lora_rank * shape.num_attention_heads * (nope + v_dim)
        sharded += shape.num_attention_heads * v_dim * h
        attention = replicated + sharded / tp
    else:
        q_width = shape.num_attention_heads * shape.head_dim
        # tp above the KV heads: each rank holds the whole KV head its queries read (replicated)
        kv_width = kv_heads_per_rank(shape, tp) * shape.head_dim
        attention = 2 * h * q_width / tp + 2 * h * kv_width
        if shape.attention_bias:
            attention += q_width / tp + 2 * kv_width
    if not sparse:
        mlp = 3 * h * shape.intermediate_size / tp
    else:
        expert = 3 * h * shape.moe_intermediate_size
        routed = expert * math.ceil(shape.num_experts / ep) if ep > 1 else expert * shape.num_experts / tp
        router = h * shape.num_experts + h * shape.shared_expert_gate + shape.num_experts * shape.router_bias
        mlp = router + 3 * h * shape.shared_expert_intermediate_size / tp + routed
    return {"attention": attention, "mlp": mlp, "norms": 2 * h}


def stage_weights(shape: ModelShape, dtype: str, layout: ParallelLayout, kv_dtype: str | None = None
                  ) -> list[StageWeights]:
    """Per pipeline stage: the weights and KV bytes per token of one of its GPUs."""
    tp, ep = layout.tp, layout.ep
    linear_bytes = dtype_bytes(dtype)
    kv_bytes = dtype_bytes(kv_dtype or ("float32" if linear_bytes == 4 else "bfloat16"))
    counts = stage_layer_counts(shape.num_layers, layout.pp)
    embedding = shape.vocab_size * shape.hidden_size / tp
    out, first = [], 0
    for stage, n in enumerate(counts):
        last = stage == len(counts) - 1
        parts = {"embedding": embedding if stage == 0 else 0.0, "lm_head": 0.0, "attention": 0.0, "mlp": 0.0,
                 "norms": shape.hidden_size if last else 0.0}
        if last:  # tied weights: a later stage needs its own copy of the embedding as the head
            parts["lm_head"] = embedding if (not shape.tie_word_embeddings or stage > 0) else 0.0
        for layer in range(first, first + n):
            sparse = shape.is_moe and layer >= shape.first_dense_layers
            for part, value in _layer_params(shape, sparse, tp, ep).items():
                parts[part] += value
        params = {k: math.ceil(v) for k, v in parts.items()}
        if linear_bytes >= 2:
            weight = sum(params.values()) * linear_bytes
        else:  # quantized: only the decoder's linear layers shrink (models.weight_bytes' rule)
            weight = (params["attention"] + params["mlp"]) * linear_bytes \
                + (params["embedding"] + params["lm_head"] + params["norms"]) * 2
        experts = (math.ceil(shape.num_experts / ep) if ep > 1 else shape.num_experts) if shape.is_moe else 0
        out.append(StageWeights(stage, first, n, params, experts, int(weight),
                                kv_bytes_per_token(replace(shape, num_layers=n), kv_bytes, tp)))
        first += n
    return out


def stage_shape(shape: ModelShape, stage: StageWeights) -> ModelShape:
    """The shape whose KV arithmetic is one stage's (its layers only)."""
    return replace(shape, num_layers=stage.num_layers)


def active_params(shape: ModelShape) -> int:
    """Parameters one token passes through (routed experts: only its top-k), embedding and
    head included: the figure model cards quote as "activated" parameters."""
    from .models import param_count

    if not shape.is_moe:
        return param_count(shape)
    idle = shape.num_experts - shape.num_experts_per_tok
    moe_layers = shape.num_layers - shape.first_dense_layers
    return param_count(shape) - moe_layers * idle * 3 * shape.hidden_size * shape.moe_intermediate_size
