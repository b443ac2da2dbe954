"""The work of one step, from the model's shape and the step's tokens (ModelCost, StepFeatures,
step_features): FLOPs and bytes per part, before any device prices them (cost_model.CostModel does).
Split out of cost_model.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pagedserve.plan.kv_budget import QUANTIZED_KV_DTYPES, ModelShape, dtype_bytes, kv_bytes_per_token, kv_scale_bytes
from pagedserve.plan.models import param_breakdown

@dataclass(frozen=True)
class ModelCost:
    """Per-token and per-step quantities of one model on one TP rank."""

    num_layers: int
    hidden_size: int
    q_heads_per_rank: int
    head_dim: int
    linear_params_per_rank: float   # decoder linear layers / TP (no embedding, no LM head)
    lm_head_params_per_rank: float  # hidden x vocab / TP (vocab-parallel head)
    weight_bytes_per_rank: float    # what one step reads: linear layers + LM head
    kv_bytes_per_token: int         # one rank's share
    act_bytes: float
    tp: int
    kv_values_per_token: int = 0    # K/V values per token a read must dequantize (0: a plain cache)
    weight_bytes_per_param: float = 2.0  # 1: fp8/int8 weights (fp8 tensor cores where the device has them)
    kernels_per_step: int = 0       # kernels one forward launches on a rank (kernel_count; 0: not counted)
    gemm_kernels_per_step: int = 0  # of those, GEMMs (gemm_kernel_count): each pays a measured curve's kernel_s
    # the step's elementwise kernels (elementwise_kernels): (kind, kernels, rows per token, row width in bytes)
    elementwise_kernels: tuple = ()
    moe: bool = False  # routed experts: their grouped GEMMs are not the dense cuBLAS GEMMs a kernel profile measured

    @classmethod
    def from_shape(cls, shape: ModelShape, weight_dtype: str = "bfloat16", kv_dtype: str | None = None,
                   tp: int = 1) -> "ModelCost":
        parts = param_breakdown(shape)
        w = dtype_bytes(weight_dtype)
        act = 4 if w == 4 else 2
        kv = dtype_bytes(kv_dtype) if kv_dtype else act
        quantized = kv_dtype in QUANTIZED_KV_DTYPES
        linear = (parts["attention"] + parts["mlp"]) / tp
        if shape.is_moe:  # a token only visits its experts; weights read are (close to) all of them
            routed = 3 * shape.hidden_size * shape.moe_intermediate_size
            moe_layers = shape.num_layers - shape.first_dense_layers
            active = parts["mlp"] - moe_layers * routed * (shape.num_experts - shape.num_experts_per_tok)
            linear_flop_params = (parts["attention"] + active) / tp
        else:
            linear_flop_params = linear
        lm_head = shape.hidden_size * shape.vocab_size / tp
        heads = max(1, shape.num_attention_heads // tp)
        head_dim = shape.head_dim
        if shape.is_mla:  # attention computed in the latent: (kv_lora_rank + rope) wide keys
            head_dim = (shape.kv_lora_rank or 0) + (shape.qk_rope_head_dim or 0)
        return cls(
            num_layers=shape.num_layers, hidden_size=shape.hidden_size, q_heads_per_rank=heads,
            head_dim=head_dim, linear_params_per_rank=linear_flop_params, lm_head_params_per_rank=lm_head,
            weight_bytes_per_rank=(linear + lm_head) * w,
            kv_bytes_per_token=kv_bytes_per_token(shape, kv, tp, kv_scale_bytes(kv_dtype) if kv_dtype else 0),
            act_bytes=act, tp=tp,
            kv_values_per_token=kv_bytes_per_token(shape, 1, tp) if quantized else 0,
            weight_bytes_per_param=w,
            kernels_per_step=kernel_count(shape),
            gemm_kernels_per_step=gemm_kernel_count(shape),
            elementwise_kernels=elementwise_kernels(shape, tp, act),
            moe=shape.is_moe,
        )


# Kernels one forward pass launches, counted from the layer structure vLLM's GPU model runner executes
# (one graph per decode step; the count is the same eagerly):
#  * attention block, GQA/MHA: the residual add + RMSNorm (one fused kernel), the QKV GEMM, rotary, the KV
#    cache write, attention, the O GEMM: 6;
#  * MLA (DeepSeek-V2/V3): the norm, the q/kv down-projections (q_a + kv_a), their two RMSNorms, q up-
#    projection, rotary, the latent cache write, attention with the absorbed up-projections (one
#    bmm before and one after the kernel), the O GEMM: 11;
#  * dense MLP: the fused residual add + norm, the gate/up GEMM, SiLU-and-mul, the down GEMM: 4;
#  * MoE MLP (fused-MoE kernels): the norm, the router GEMM, top-k softmax, the token sort by expert
#    (align), the grouped gate/up GEMM, SiLU-and-mul, the grouped down GEMM, the sum over the top k: 8;
#    shared experts add their gate/up GEMM, activation and down GEMM (3);
#  * per step, once: the embedding lookup (on the first pipeline stage), the final norm, the LM head, and
#    the sampler's two (logits to probabilities, the pick; on the last): 5.
# A tensor-parallel all-reduce (2 per layer) is a kernel too, but its latency term
# (CostParams.allreduce_latency_s) already prices it: not counted here.
KERNELS_ATTENTION = 6
KERNELS_ATTENTION_MLA = 11
KERNELS_DENSE_MLP = 4
KERNELS_MOE_MLP = 8
KERNELS_SHARED_EXPERTS = 3
KERNELS_FIRST_STAGE = 1
KERNELS_LAST_STAGE = 4
KERNELS_PER_STEP_FIXED = KERNELS_FIRST_STAGE + KERNELS_LAST_STAGE


def kernel_count(shape: ModelShape) -> int:
    """Kernels one forward pass of `shape` launches on one rank (see the counts above)."""
    attention = KERNELS_ATTENTION_MLA if shape.is_mla else KERNELS_ATTENTION
    if shape.is_moe:
        moe_layers = shape.num_layers - shape.first_dense_layers
        moe = KERNELS_MOE_MLP + (KERNELS_SHARED_EXPERTS if shape.shared_expert_intermediate_size else 0)
        mlp = shape.first_dense_layers * KERNELS_DENSE_MLP + moe_layers * moe
    else:
        mlp = shape.num_layers * KERNELS_DENSE_MLP
    return shape.num_layers * attention + mlp + KERNELS_PER_STEP_FIXED


# Of those kernels, the GEMMs (a measured GEMM curve charges each its fixed kernel time, cost_params.KERNEL_PROFILES):
# QKV and O (MLA: the fused q/kv down-projection, q up-projection, the two absorbed bmm, O); the dense MLP's gate/up
# and down; an MoE MLP's router and its two grouped expert GEMMs (+2 for shared experts); the LM head, once.
GEMMS_ATTENTION = 2
GEMMS_ATTENTION_MLA = 5
GEMMS_DENSE_MLP = 2
GEMMS_MOE_MLP = 3
GEMMS_SHARED_EXPERTS = 2


def gemm_kernel_count(shape: ModelShape, last_stage: bool = True) -> int:
    """GEMM kernels one forward pass of `shape` runs on one rank (the LM head only on the last stage)."""
    attention = GEMMS_ATTENTION_MLA if shape.is_mla else GEMMS_ATTENTION
    if shape.is_moe:
        moe = GEMMS_MOE_MLP + (GEMMS_SHARED_EXPERTS if shape.shared_expert_intermediate_size else 0)
        mlp = shape.first_dense_layers * GEMMS_DENSE_MLP + (shape.num_layers - shape.first_dense_layers) * moe
    else:
        mlp = shape.num_layers * GEMMS_DENSE_MLP
    return shape.num_layers * attention + mlp + (1 if last_stage else 0)


def elementwise_kernels(shape: ModelShape, tp: int, act_bytes: float, first_stage: bool = True,
                        last_stage: bool = True) -> tuple:
    """The elementwise kernels of one forward pass on one rank, as (kind, kernels, rows per token, row width in
    bytes), priced by cost_params.elementwise_seconds over the step's tokens: per layer two fused residual-add +
    RMSNorm (the attention's and the MLP's input), rotary on q and k, SiLU-and-mul (an MoE layer's over each
    token's k expert rows, its shared experts' over one); MLA's two latent norms; the embedding on the first
    stage and the final norm on the last. Kinds and bytes: cost_params.KERNEL_PROFILES."""
    h, layers = shape.hidden_size * act_bytes, shape.num_layers
    q_heads = max(1, shape.num_attention_heads // tp)
    out = [("add_norm", 2 * layers, 1, h)]
    if shape.is_mla:
        rope = shape.qk_rope_head_dim or 0
        out.append(("rope", layers, 1, (q_heads + 1) * rope * act_bytes))
        if shape.q_lora_rank:
            out.append(("norm", layers, 1, shape.q_lora_rank * act_bytes))
        out.append(("norm", layers, 1, (shape.kv_lora_rank or 0) * act_bytes))
    else:
        kv_heads = max(1, shape.num_kv_heads // tp)
        out.append(("rope", layers, 1, (q_heads + kv_heads) * shape.head_dim * act_bytes))
    if shape.is_moe:
        moe_layers = layers - shape.first_dense_layers
        if shape.first_dense_layers:
            out.append(("act", shape.first_dense_layers, 1, shape.intermediate_size / tp * act_bytes))
        out.append(("act", moe_layers, shape.num_experts_per_tok, shape.moe_intermediate_size / tp * act_bytes))
        if shape.shared_expert_intermediate_size:
            out.append(("act", moe_layers, 1, shape.shared_expert_intermediate_size / tp * act_bytes))
    else:
        out.append(("act", layers, 1, shape.intermediate_size / tp * act_bytes))
    if first_stage:
        out.append(("emb", 1, 1, h))
    if last_stage:
        out.append(("add_norm", 1, 1, h))
    return tuple(e for e in out if e[1] > 0 and e[3] > 0)


@dataclass
class StepFeatures:
    """The work of one step. Attention is counted as a paged kernel does it (`attn_*`); what a
    padded backend adds on top is kept apart (`attn_pad_*`), paid at the model's pad share."""

    num_tokens: int
    num_reqs: int
    num_prefills: int
    linear_flops: float
    linear_bytes: float
    attn_flops: float
    attn_bytes: float
    allreduce_bytes: float
    num_allreduces: int
    swap_bytes: float = 0.0
    attn_pad_flops: float = 0.0
    attn_pad_bytes: float = 0.0
    num_outputs: int = 0
    # the decodes' share of the attention terms above (the rest is the prompt chunks'): a mixed
    # step runs them as separate work, each at its own bound (see CostModel.breakdown)
    attn_decode_flops: float = 0.0
    attn_decode_bytes: float = 0.0
    attn_decode_pad_flops: float = 0.0
    attn_decode_pad_bytes: float = 0.0
    # the LM head's share of the linear terms above: its rows are the step's requests, not its tokens
    lm_head_flops: float = 0.0
    lm_head_bytes: float = 0.0


def step_features(model: ModelCost, new_tokens: Sequence[int], context_lens: Sequence[int],
                  num_swap_blocks: int = 0, block_size: int = 16, num_outputs: int | None = None) -> StepFeatures:
    """The work of one step, O(batch): `new_tokens[i]` computed after `context_lens[i] - new_tokens[i]`.
    `num_outputs`: requests that sample a token (default: every one whose chunk ends its prompt
    is unknown here, so all of them)."""
    num_tokens = 0
    pairs = 0       # query-key pairs a paged kernel computes
    kv_read = 0     # tokens of KV it reads
    pad_pairs = 0   # what a padded backend computes on top
    pad_read = 0
    num_prefills = 0
    num_decodes = 0
    decode_ctx = 0
    max_decode_ctx = 0
    for n, c in zip(new_tokens, context_lens):
        num_tokens += n
        kv_read += c
        if n == 1:
            num_decodes += 1
            decode_ctx += c
            if c > max_decode_ctx:
                max_decode_ctx = c
            continue
        num_prefills += 1
        # causal: query k (0-based) sees c - n + k + 1 keys; a padded backend computes a
        # chunk-after-prefix's whole n x c rectangle
        causal = n * c - n * (n - 1) // 2
        pairs += causal
        if c > n:
            pad_pairs += n * c - causal
    pairs += decode_ctx
    decode_pad = 0
    if num_decodes:  # padded: every decode attends over the longest decode context
        decode_pad = num_decodes * max_decode_ctx - decode_ctx
        pad_pairs += decode_pad
        pad_read += decode_pad
    num_reqs = len(new_tokens)
    lm_head_flops = 2.0 * num_reqs * model.lm_head_params_per_rank
    linear_flops = 2.0 * num_tokens * model.linear_params_per_rank + lm_head_flops
    linear_bytes = model.weight_bytes_per_rank if num_reqs else 0.0
    lm_head_bytes = model.lm_head_params_per_rank * model.weight_bytes_per_param if num_reqs else 0.0
    per_pair = 4.0 * model.num_layers * model.q_heads_per_rank * model.head_dim
    if model.tp > 1 and num_tokens:
        allreduce_bytes = 2 * model.num_layers * num_tokens * model.hidden_size * model.act_bytes
        num_allreduces = 2 * model.num_layers
    else:
        allreduce_bytes, num_allreduces = 0.0, 0
    swap_bytes = float(num_swap_blocks * block_size * model.kv_bytes_per_token)
    kvb = model.kv_bytes_per_token
    return StepFeatures(num_tokens, num_reqs, num_prefills, linear_flops, linear_bytes, per_pair * pairs,
                        float(kv_read * kvb), allreduce_bytes, num_allreduces, swap_bytes,
                        per_pair * pad_pairs, float(pad_read * kvb),
                        num_reqs if num_outputs is None else num_outputs,
                        per_pair * decode_ctx, float(decode_ctx * kvb), per_pair * decode_pad, float(decode_pad * kvb),
                        lm_head_flops, lm_head_bytes)
