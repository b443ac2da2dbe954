"""Read a HF checkpoint's config.json into a ModelConfig, refusing what the model code cannot run.

Invariant: a checkpoint that loads runs the same math as HF transformers' own class for its
`architectures` entry. Every config field is in one of three groups (the tables below):
honoured (the model code reads it), ignored (HF's modeling for this architecture does not
read it either, or it cannot change inference output), refused (it changes the math and the
model code does not implement that value: loading raises ValueError("model: <field> ...")).
A field the tables do not name is logged and ignored: HF's class for the architecture does
not read it either, so it cannot make our output differ from HF's. Fields that change the
math in *other* HF architectures (softcapping, qk-norm, MoE, ...) are refused instead, since
their presence means the checkpoint is not the plain architecture its `architectures` claims.

No torch here: the engine reads this before it decides where the model runs.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("pagedserve.model")

# architecture -> the model_type HF's AutoModel maps to it (AutoModel picks the class by model_type)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
                 "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                 "DeepseekV3ForCausalLM": "deepseek_v3"}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

HONOURED, IGNORED, REFUSED = "honoured", "ignored", "refused"

# Fields of LlamaConfig, Qwen2Config, MistralConfig and their PreTrainedConfig base (transformers 5),
# plus the pre-5 spellings. (group, why). Per-architecture differences are in ARCH_FIELDS.
CONFIG_FIELDS: dict[str, tuple[str, str]] = {
    "architectures": (HONOURED, "picks the model class; must name a supported architecture"),
    "model_type": (HONOURED, "HF's AutoModel picks the class by it: refused unless it matches architectures"),
    "vocab_size": (HONOURED, "embedding and head rows"),
    "hidden_size": (HONOURED, "model width"),
    "intermediate_size": (HONOURED, "MLP width"),
    "num_hidden_layers": (HONOURED, "layer count"),
    "num_attention_heads": (HONOURED, "query heads; refused unless a multiple of num_key_value_heads"),
    "num_key_value_heads": (HONOURED, "KV heads (GQA/MQA); null means num_attention_heads"),
    "head_dim": (HONOURED, "per-head width; may differ from hidden_size / heads; refused if odd"),
    "hidden_act": (HONOURED, "silu (or its alias swish) only; any other activation is refused"),
    "rms_norm_eps": (HONOURED, "RMSNorm epsilon"),
    "max_position_embeddings": (HONOURED, "context limit, and the reference length of dynamic NTK RoPE"),
    "tie_word_embeddings": (HONOURED, "the head reuses the embedding matrix"),
    "rope_parameters": (HONOURED, "transformers>=5 RoPE layout: rope_theta, rope_type and its factors "
                                  "(see ROPE_TYPES); per-layer-type nesting and unknown rope_types are refused"),
    "rope_theta": (HONOURED, "transformers<5 layout; refused if it disagrees with rope_parameters.rope_theta"),
    "rope_scaling": (HONOURED, "transformers<5 layout of the RoPE scaling dict (`type` or `rope_type`); "
                               "refused if it disagrees with rope_parameters"),
    "partial_rotary_factor": (REFUSED, "only a value of 1 (rotate the whole head) is implemented"),
    "original_max_position_embeddings": (HONOURED, "top-level copy that HF prefers for llama3/yarn; "
                                                   "refused if it disagrees with the rope dict"),
    "dtype": (HONOURED, "checkpoint dtype, what `--dtype auto` resolves from"),
    "torch_dtype": (HONOURED, "transformers<5 spelling of dtype"),
    "eos_token_id": (HONOURED, "read by the engine as stop tokens"),
    "quantization_config": (REFUSED, "quantized weights are not implemented"),
    "attention_dropout": (IGNORED, "dropout is off at inference"),
    "initializer_range": (IGNORED, "weight init for training only"),
    "use_cache": (IGNORED, "HF's own KV-cache switch; the paged cache is always on"),
    "pad_token_id": (IGNORED, "only sets the embedding's padding_idx, which affects training gradients"),
    "bos_token_id": (IGNORED, "the tokenizer, not the model, adds BOS"),
    "pretraining_tp": (IGNORED, "transformers<5 split the projections into this many slices and summed them: "
                                "the same product; transformers 5 does not read it"),
    "transformers_version": (IGNORED, "provenance"),
    "_name_or_path": (IGNORED, "display name only"),
    "output_attentions": (IGNORED, "what HF returns, not what it computes"),
    "output_hidden_states": (IGNORED, "what HF returns, not what it computes"),
    "return_dict": (IGNORED, "what HF returns, not what it computes"),
    "chunk_size_feed_forward": (IGNORED, "not read by the Llama-family modeling code"),
    "id2label": (IGNORED, "sequence-classification heads only"),
    "label2id": (IGNORED, "sequence-classification heads only"),
    "problem_type": (IGNORED, "sequence-classification heads only"),
    "is_encoder_decoder": (REFUSED, "true is refused: decoder-only models only"),
    "attention_bias": (HONOURED, "Llama: bias on q/k/v/o (ARCH_FIELDS has Qwen2/Mistral)"),
    "mlp_bias": (HONOURED, "Llama: bias on gate/up/down (ARCH_FIELDS has Qwen2/Mistral)"),
    "sliding_window": (IGNORED, "Llama: LlamaAttention has no window (ARCH_FIELDS has Qwen2/Mistral)"),
    "layer_types": (REFUSED, "Llama/Mistral do not read it; refused unless all equal to what runs "
                             "(a mix is a Ministral-style per-layer window this code does not run)"),
}

ARCH_FIELDS: dict[str, dict[str, tuple[str, str]]] = {
    "Qwen2ForCausalLM": {
        "attention_bias": (IGNORED, "Qwen2 always has q/k/v bias and no o_proj bias; HF does not read it"),
        "mlp_bias": (IGNORED, "Qwen2's MLP has no bias; HF does not read it"),
        "use_sliding_window": (HONOURED, "false: no layer has a window"),
        "sliding_window": (HONOURED, "window of the layers layer_types marks sliding_attention"),
        "max_window_layers": (HONOURED, "layers from this index on slide when layer_types is absent"),
        "layer_types": (HONOURED, "per-layer full/sliding attention: all-full or all-sliding runs, "
                                  "a mix is refused (the attention backend takes one window per model)"),
    },
    "MistralForCausalLM": {
        "attention_bias": (IGNORED, "Mistral has no attention biases; HF does not read it"),
        "mlp_bias": (IGNORED, "Mistral's MLP has no bias; HF does not read it"),
        "sliding_window": (HONOURED, "every layer attends to the last sliding_window tokens; null = full"),
    },
    "MixtralForCausalLM": {
        "attention_bias": (IGNORED, "Mixtral has no attention biases; HF does not read it"),
        "mlp_bias": (IGNORED, "Mixtral's experts have no bias; HF does not read it"),
        "sliding_window": (HONOURED, "every layer attends to the last sliding_window tokens; null = full"),
        "intermediate_size": (HONOURED, "width of each expert's MLP"),
        "num_local_experts": (HONOURED, "routed experts per layer"),
        "num_experts_per_tok": (HONOURED, "experts each token visits (top-k of the router's softmax, "
                                          "renormalised to sum 1 as HF's Mixtral router does)"),
        "output_router_logits": (IGNORED, "what HF returns (router logits for the aux loss), not what it computes"),
        "router_aux_loss_coef": (IGNORED, "weight of a training loss"),
        "router_jitter_noise": (IGNORED, "HF multiplies the input by noise only in training mode"),
    },
    "Qwen2MoeForCausalLM": {
        "attention_bias": (IGNORED, "Qwen2-MoE reads qkv_bias instead; HF does not read it"),
        "mlp_bias": (IGNORED, "Qwen2-MoE's MLPs have no bias; HF does not read it"),
        "qkv_bias": (HONOURED, "bias on q/k/v (o_proj never has one)"),
        "use_sliding_window": (HONOURED, "with max_window_layers, which layers slide: all-full or all-sliding "
                                         "runs, a mix is refused"),
        "sliding_window": (HONOURED, "window of the layers that slide"),
        "max_window_layers": (HONOURED, "only layers below this index may slide (Qwen2MoeConfig's rule)"),
        "layer_types": (HONOURED, "per-layer full/sliding attention: all-full or all-sliding runs, a mix is refused"),
        "intermediate_size": (HONOURED, "width of the dense MLP of layers that are not sparse"),
        "decoder_sparse_step": (HONOURED, "layer i is sparse when (i + 1) % decoder_sparse_step == 0 "
                                          "and i is not in mlp_only_layers"),
        "mlp_only_layers": (HONOURED, "layers that use the dense MLP whatever decoder_sparse_step says"),
        "num_experts": (HONOURED, "routed experts per sparse layer"),
        "num_experts_per_tok": (HONOURED, "experts each token visits (top-k of the router's softmax)"),
        "moe_intermediate_size": (HONOURED, "width of each routed expert's MLP"),
        "norm_topk_prob": (HONOURED, "true: renormalise the top-k probabilities to sum 1; false: use them as they are"),
        "shared_expert_intermediate_size": (HONOURED, "width of the shared expert every token visits, scaled by "
                                                      "sigmoid(shared_expert_gate(x))"),
        "output_router_logits": (IGNORED, "what HF returns (router logits for the aux loss), not what it computes"),
        "router_aux_loss_coef": (IGNORED, "weight of a training loss"),
    },
    "DeepseekV3ForCausalLM": {
        "attention_bias": (HONOURED, "bias on q_a_proj, kv_a_proj_with_mqa and o_proj"),
        "mlp_bias": (IGNORED, "DeepSeek-V3's MLPs have no bias; HF does not read it"),
        "sliding_window": (IGNORED, "DeepSeek-V3's attention has no window; HF does not read it"),
        "head_dim": (IGNORED, "DeepseekV3Config overwrites it with qk_rope_head_dim (the rotary width)"),
        "qk_head_dim": (IGNORED, "DeepseekV3Config overwrites it with qk_nope_head_dim + qk_rope_head_dim"),
        "num_key_value_heads": (HONOURED, "must equal num_attention_heads: MLA expands the latent into every "
                                          "head (HF's attention fails otherwise)"),
        "intermediate_size": (HONOURED, "width of the dense MLP of the first first_k_dense_replace layers"),
        "q_lora_rank": (HONOURED, "rank of the query's low-rank projection (q_a_proj, norm, q_b_proj); "
                                  "null: one q_proj"),
        "kv_lora_rank": (HONOURED, "width of the compressed KV latent the cache stores per token"),
        "qk_nope_head_dim": (HONOURED, "per-head query/key width without RoPE"),
        "qk_rope_head_dim": (HONOURED, "per-head query width with RoPE, and the shared rope key the cache stores"),
        "v_head_dim": (HONOURED, "per-head value width"),
        "rope_interleave": (HONOURED, "true: RoPE rotates interleaved pairs (the rows are de-interleaved at "
                                      "load, which rotates the same pairs); false: halves, as Llama"),
        "n_routed_experts": (HONOURED, "routed experts per sparse layer"),
        "num_experts_per_tok": (HONOURED, "experts each token visits"),
        "n_shared_experts": (HONOURED, "shared experts every token visits (one MLP n_shared_experts x "
                                       "moe_intermediate_size wide)"),
        "moe_intermediate_size": (HONOURED, "width of each routed expert's MLP"),
        "first_k_dense_replace": (HONOURED, "the first layers use the dense MLP"),
        "n_group": (HONOURED, "expert groups of the group-limited top-k"),
        "topk_group": (HONOURED, "groups a token may pick experts from (groups ranked by their top-2 scores)"),
        "norm_topk_prob": (HONOURED, "renormalise the chosen experts' sigmoid scores to sum 1"),
        "routed_scaling_factor": (HONOURED, "multiplies the routed experts' weights"),
        "num_nextn_predict_layers": (IGNORED, "the multi-token-prediction layer (speculative decoding): HF does "
                                              "not build it and skips its tensors, and so does the loader"),
        "output_router_logits": (IGNORED, "what HF returns (router logits for the aux loss), not what it computes"),
        # DeepSeek's own (remote-code) config fields, in the published config.json; HF's class does
        # not read them, but their values say which routing the checkpoint was trained with.
        "scoring_func": (REFUSED, "only 'sigmoid' (what DeepSeek-V3 and HF's class use) is implemented"),
        "topk_method": (REFUSED, "only 'noaux_tc' (bias-corrected group-limited top-k) is implemented"),
        "moe_layer_freq": (REFUSED, "only 1 (every layer past first_k_dense_replace is sparse) is implemented"),
        "ep_size": (IGNORED, "the training run's expert-parallel layout; serving chooses its own"),
        "aux_loss_alpha": (IGNORED, "weight of a training loss"),
        "seq_aux": (IGNORED, "a training loss switch"),
        "auto_map": (IGNORED, "remote-code class names; `architectures` picks the class"),
    },
}

# Fields that change the math in other HF architectures. Here they would be silently dropped,
# so a non-neutral value refuses the load: the checkpoint is not what `architectures` says.
FOREIGN_FIELDS: dict[str, str] = {
    "attn_logit_softcapping": "attention logit soft-capping (Gemma 2) is not implemented",
    "final_logit_softcapping": "final logit soft-capping (Gemma 2) is not implemented",
    "query_pre_attn_scalar": "a custom attention scale (Gemma) is not implemented",
    "use_qk_norm": "q/k normalisation is not implemented",
    "qk_layernorm": "q/k normalisation is not implemented",
    "use_qk_layernorm": "q/k normalisation is not implemented",
    "attention_multiplier": "a custom attention scale (Granite) is not implemented",
    "embedding_multiplier": "embedding scaling (Granite) is not implemented",
    "residual_multiplier": "residual scaling (Granite) is not implemented",
    "logits_scaling": "logit scaling (Granite) is not implemented",
    "logit_scale": "logit scaling (Cohere) is not implemented",
    "use_mrope": "multimodal RoPE is not implemented",
    "mrope_section": "multimodal RoPE is not implemented",
    "num_experts": "mixture-of-experts layers are not implemented",
    "num_local_experts": "mixture-of-experts layers are not implemented",
    "n_routed_experts": "mixture-of-experts layers are not implemented",
    "use_parallel_residual": "parallel attention/MLP residuals are not implemented",
    "no_rope_layers": "layers without RoPE are not implemented",
    "attention_chunk_size": "chunked local attention (Llama 4) is not implemented",
    "clip_qkv": "q/k/v clipping is not implemented",
    "rope_interleave": "interleaved RoPE is not implemented",
    "add_cross_attention": "cross-attention is not implemented",
    "pruned_heads": "pruned attention heads are not implemented",
}
_NEUTRAL = (None, False, 0, [], {}, "")
# Multipliers whose value 1 leaves the math as it is (attention_multiplier is not one of them:
# Granite uses it *instead of* head_dim ** -0.5).
_NEUTRAL_AT_ONE = frozenset({"embedding_multiplier", "residual_multiplier", "logits_scaling", "logit_scale"})

# RoPE keys each rope_type reads (HF's modeling_rope_utils); `type` is the pre-5 spelling of rope_type.
ROPE_TYPES: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                       "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
}
# Keys HF knows for some rope_type; one that the checkpoint's type does not read is ignored, as HF ignores it.
_HF_ROPE_KEYS = frozenset({"rope_theta", "rope_type", "type", "partial_rotary_factor", "factor",
                           "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                           "short_factor", "long_factor", "low_freq_factor", "high_freq_factor", "mscale",
                           "mscale_all_dim", "truncate", "mrope_section"})


def _refuse(message: str) -> ValueError:
    return ValueError(f"model: {message}")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE as HF computes it for this checkpoint. `original_max_position_embeddings` is the
    pretraining length llama3/yarn scale from, and for dynamic NTK the length past which the
    base grows (HF uses max_position_embeddings there)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None     # llama3
    high_freq_factor: float | None = None    # llama3
    beta_fast: float = 32.0                  # yarn
    beta_slow: float = 1.0                   # yarn
    truncate: bool = True                    # yarn
    attention_factor: float = 1.0            # yarn: scales cos and sin (the "mscale")

    @property
    def depends_on_prompt_len(self) -> bool:
        """Dynamic NTK rotates a prompt longer than the original length with a base grown
        for that prompt's length, so the same tokens get different K in different requests."""
        return self.rope_type == "dynamic"

    def prefix_cache_key(self, num_prompt_tokens: int) -> bytes:
        """Extra prefix-cache key for a request: the KV of its blocks depends on this too."""
        if self.depends_on_prompt_len and num_prompt_tokens > (self.original_max_position_embeddings or 0):
            return b"dynamic-ntk-prompt-len:%d" % num_prompt_tokens
        return b""


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP as HF's class for the architecture computes it.

    Routing: `scoring` turns router logits into scores ("softmax" over all experts, or
    "sigmoid" per expert); the top `top_k` experts are chosen (DeepSeek: by score +
    correction bias, only among the `topk_groups` best of `num_groups` groups); their
    scores, renormalised to sum 1 when `renormalize`, times `routed_scaling_factor`,
    weight the experts' outputs. A shared expert (width `shared_intermediate_size`, 0 =
    none) sees every token, scaled by sigmoid(shared_expert_gate(x)) when `shared_gate`.
    `sparse_layers[i]` says whether layer i is an MoE layer or a dense MLP of the model's
    intermediate_size.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str                     # "softmax" | "sigmoid"
    renormalize: bool
    sparse_layers: tuple[bool, ...]
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    correction_bias: bool = False    # DeepSeek-V3's e_score_correction_bias (choice only)
    renormalize_eps: float = 0.0     # DeepSeek adds 1e-20 to the denominator
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    router_fp32: bool = False        # DeepSeek keeps the router weight in fp32 (HF's _keep_in_fp32_modules)


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention. The cache holds, per token and layer, the
    normed KV latent (kv_lora_rank) and the rotated rope key (qk_rope_head_dim), shared by
    all heads; kv_b_proj expands the latent into each head's nope key and value."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class ModelConfig:
    path: Path
    architecture: str
    hf_config: dict
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    checkpoint_dtype: str
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None

    @property
    def name(self) -> str:
        return self.hf_config.get("_name_or_path") or self.path.name

    def kv_cache_shape(self, num_slots: int, num_kv_heads: int | None = None) -> tuple[int, int, int, int, int]:
        """The KV pool's shape: [layers, K and V, slots, kv heads, head_dim] (`num_kv_heads`:
        one tensor-parallel rank's, default all); for MLA [layers, 1, slots, 1,
        kv_lora_rank + qk_rope_head_dim] (latent and rope key in one entry, shared by all
        heads). The block copy and swap paths read only this layout."""
        if self.mla is not None:
            return (self.num_layers, 1, num_slots, 1, self.mla.cache_width)
        return (self.num_layers, 2, num_slots, num_kv_heads or self.num_kv_heads, self.head_dim)

    @property
    def max_model_len(self) -> int:
        """The longest sequence the model runs. Dynamic NTK exists to run past
        max_position_embeddings (by growing the RoPE base), up to `factor` times it."""
        if self.rope.rope_type == "dynamic" and self.rope.factor > 1:
            return int(self.max_position_embeddings * self.rope.factor)
        return self.max_position_embeddings


def field_group(architecture: str, name: str) -> tuple[str, str] | None:
    """(group, why) for a config field of this architecture, or None if the tables do not name it."""
    return ARCH_FIELDS.get(architecture, {}).get(name) or CONFIG_FIELDS.get(name)


def read_model_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise _refuse(f"{str(path)!r} is not a model directory (no config.json there); "
                      "pass a local HF checkpoint directory")
    return parse_model_config(json.loads(cfg_file.read_text()), path)


def parse_model_config(cfg: dict, path: Path) -> ModelConfig:
    arch = _architecture(cfg)
    _refuse_foreign_fields(cfg, arch)
    _refuse_unimplemented(cfg)
    unknown = sorted(k for k in cfg if field_group(arch, k) is None and k not in FOREIGN_FIELDS)
    if unknown:
        logger.warning("config.json fields ignored (HF's %s does not read them either): %s", arch, ", ".join(unknown))
    heads = _positive_int(cfg, "num_attention_heads")
    hidden = _positive_int(cfg, "hidden_size")
    kv_heads = cfg.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or heads % kv_heads:
        raise _refuse(f"num_key_value_heads={kv_heads!r} must divide num_attention_heads={heads}")
    mla = _mla_config(cfg, heads, kv_heads) if arch == "DeepseekV3ForCausalLM" else None
    head_dim = mla.qk_rope_head_dim if mla else cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise _refuse(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                          "and head_dim is not given")
        head_dim = hidden // heads
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise _refuse(f"head_dim={head_dim!r}: RoPE needs a positive even head_dim")
    max_pos = _positive_int(cfg, "max_position_embeddings", default=2048)
    is_llama = arch == "LlamaForCausalLM"
    num_layers = _positive_int(cfg, "num_hidden_layers")
    rope = read_rope_config(cfg, max_pos)
    if mla is not None:
        mla = _with_softmax_scale(mla, cfg, rope)
    return ModelConfig(
        path=path,
        architecture=arch,
        hf_config=cfg,
        vocab_size=_positive_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=(arch == "Qwen2ForCausalLM" or (is_llama and bool(cfg.get("attention_bias", False)))
                  or (arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True)))),
        o_proj_bias=(is_llama or arch == "DeepseekV3ForCausalLM") and bool(cfg.get("attention_bias", False)),
        mlp_bias=is_llama and bool(cfg.get("mlp_bias", False)),
        sliding_window=_sliding_window(arch, cfg),
        checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype") or "float32",
        moe=_moe_config(arch, cfg, num_layers) if arch in MOE_ARCHITECTURES else None,
        mla=mla,
    )


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise _refuse(f"architecture {archs or '(none given)'} is not supported; "
                      f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    model_type = cfg.get("model_type")
    if model_type is not None and model_type != ARCHITECTURES[arch]:
        raise _refuse(f"model_type {model_type!r} does not match architecture {arch} "
                      f"(HF would load its {model_type!r} class); expected {ARCHITECTURES[arch]!r}")
    return arch


def _refuse_foreign_fields(cfg: dict, arch: str) -> None:
    for name, why in FOREIGN_FIELDS.items():
        if name in ARCH_FIELDS.get(arch, {}):  # this architecture's own field, classified there
            continue
        value = cfg.get(name)
        if value in _NEUTRAL or (name in _NEUTRAL_AT_ONE and value == 1):
            continue
        raise _refuse(f"{name}={value!r}: {why}")


def _refuse_unimplemented(cfg: dict) -> None:
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?") if isinstance(cfg["quantization_config"], dict) else "?"
        raise _refuse(f"quantization_config (quant_method={method!r}): quantized weights are not implemented")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise _refuse(f"hidden_act={act!r} is not implemented (only silu)")
    if cfg.get("is_encoder_decoder"):
        raise _refuse("is_encoder_decoder=true: only decoder-only models are implemented")
    prf = cfg.get("partial_rotary_factor")
    if prf is not None and prf != 1:
        raise _refuse(f"partial_rotary_factor={prf!r}: only rotating the whole head (1.0) is implemented")


def _positive_int(cfg: dict, key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise _refuse(f"config.json lacks {key}")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _refuse(f"{key}={value!r} must be a positive integer")
    return value


def _sliding_window(arch: str, cfg: dict) -> int | None:
    """The window every layer uses, or None. HF's attention per architecture:
    Llama: none (sliding_window is not read); Mistral: sliding_window on every layer;
    Qwen2: only layers whose layer_types entry is sliding_attention, and only with use_sliding_window."""
    num_layers = cfg.get("num_hidden_layers")
    layer_types = cfg.get("layer_types")
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        if layer_types is None and arch == "Qwen2ForCausalLM":  # derived as Qwen2Config.__post_init__ does
            first = cfg.get("max_window_layers", 28)
            layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                           for i in range(num_layers)]
        elif layer_types is None:  # Qwen2MoeConfig.__post_init__: even layers below max_window_layers
            below = cfg.get("max_window_layers", 28)
            layer_types = ["sliding_attention" if window is not None and (i + 1) % 2 and i < below
                           else "full_attention" for i in range(num_layers)]
        kinds = set(layer_types)
        if kinds == {"full_attention"}:
            return None
        if kinds == {"sliding_attention"} and window is not None:
            return _window_value(window)
        if "sliding_attention" in kinds and window is None:
            raise _refuse(f"layer_types marks layers sliding_attention but no window applies (sliding_window="
                          f"{cfg.get('sliding_window')!r}, use_sliding_window={cfg.get('use_sliding_window', False)})")
        raise _refuse(f"layer_types={sorted(kinds)} with sliding_window={window!r} "
                      f"(use_sliding_window={cfg.get('use_sliding_window', False)}): per-layer attention types "
                      "are not implemented; only all-full or all-sliding layers run")
    window = cfg.get("sliding_window") if arch in ("MistralForCausalLM", "MixtralForCausalLM") else None
    if layer_types is not None:
        expected = "sliding_attention" if window is not None else "full_attention"
        if set(layer_types) - {expected}:
            raise _refuse(f"layer_types={sorted(set(layer_types))}: per-layer attention types are not "
                          f"implemented for {arch} (HF's {arch} ignores them; this looks like a checkpoint "
                          "of another architecture)")
    return None if window is None else _window_value(window)


def _window_value(window: Any) -> int:
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise _refuse(f"sliding_window={window!r} must be a positive integer or null")
    return window


def _moe_config(arch: str, cfg: dict, num_layers: int) -> MoEConfig:
    """The MoE fields of each architecture, as its HF class reads them."""
    if arch == "MixtralForCausalLM":
        num_experts = _positive_int(cfg, "num_local_experts", default=8)
        return MoEConfig(num_experts=num_experts, top_k=_top_k(cfg, num_experts, default=2),
                         intermediate_size=_positive_int(cfg, "intermediate_size"), scoring="softmax",
                         renormalize=True, sparse_layers=(True,) * num_layers)
    if arch == "Qwen2MoeForCausalLM":
        num_experts = _positive_int(cfg, "num_experts", default=60)
        step = _positive_int(cfg, "decoder_sparse_step", default=1)
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
            raise _refuse(f"mlp_only_layers={dense!r} must be a list of layer indices")
        shared = cfg.get("shared_expert_intermediate_size", 5632)
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise _refuse(f"shared_expert_intermediate_size={shared!r} must be a non-negative integer")
        return MoEConfig(num_experts=num_experts, top_k=_top_k(cfg, num_experts, default=4),
                         intermediate_size=_positive_int(cfg, "moe_intermediate_size", default=1408),
                         scoring="softmax", renormalize=_flag(cfg, "norm_topk_prob", False),
                         sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
                         shared_intermediate_size=shared, shared_gate=shared > 0)
    # DeepseekV3ForCausalLM
    for name, only in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if name in cfg and cfg[name] != only:
            raise _refuse(f"{name}={cfg[name]!r}: only {only!r} is implemented (DeepSeek-V3's routing)")
    num_experts = _positive_int(cfg, "n_routed_experts", default=256)
    groups = _positive_int(cfg, "n_group", default=8)
    topk_groups = _positive_int(cfg, "topk_group", default=4)
    if num_experts % groups:
        raise _refuse(f"n_group={groups} must divide n_routed_experts={num_experts}")
    if topk_groups > groups:
        raise _refuse(f"topk_group={topk_groups} must be <= n_group={groups}")
    if num_experts // groups < 2:
        raise _refuse(f"n_routed_experts / n_group = {num_experts // groups}: groups are ranked by their top-2 "
                      "scores, so each needs at least 2 experts")
    top_k = _top_k(cfg, num_experts, default=8)
    if top_k > topk_groups * (num_experts // groups):
        raise _refuse(f"num_experts_per_tok={top_k} is more than the {topk_groups} groups a token may use hold")
    first_dense = cfg.get("first_k_dense_replace", 3)
    if not isinstance(first_dense, int) or isinstance(first_dense, bool) or first_dense < 0:
        raise _refuse(f"first_k_dense_replace={first_dense!r} must be a non-negative integer")
    n_shared = cfg.get("n_shared_experts", 1)
    if not isinstance(n_shared, int) or isinstance(n_shared, bool) or n_shared < 0:
        raise _refuse(f"n_shared_experts={n_shared!r} must be a non-negative integer")
    inter = _positive_int(cfg, "moe_intermediate_size", default=2048)
    scaling = cfg.get("routed_scaling_factor", 2.5)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        raise _refuse(f"routed_scaling_factor={scaling!r} must be a number")
    return MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=inter, scoring="sigmoid",
                     renormalize=_flag(cfg, "norm_topk_prob", True),
                     sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
                     routed_scaling_factor=float(scaling), num_groups=groups, topk_groups=topk_groups,
                     correction_bias=True, renormalize_eps=1e-20, shared_intermediate_size=n_shared * inter,
                     router_fp32=True)


def _top_k(cfg: dict, num_experts: int, default: int) -> int:
    top_k = _positive_int(cfg, "num_experts_per_tok", default=default)
    if top_k > num_experts:
        raise _refuse(f"num_experts_per_tok={top_k} is more than the {num_experts} experts")
    return top_k


def _flag(cfg: dict, key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _refuse(f"{key}={value!r} must be true or false")
    return value


def _mla_config(cfg: dict, heads: int, kv_heads: int) -> MLAConfig:
    if kv_heads != heads:
        raise _refuse(f"num_key_value_heads={kv_heads} must equal num_attention_heads={heads} for MLA "
                      "(the latent is expanded into every head)")
    q_lora = cfg.get("q_lora_rank", 1536)
    if q_lora is not None:
        q_lora = _positive_int(cfg, "q_lora_rank")
    rope_dim = _positive_int(cfg, "qk_rope_head_dim", default=64)
    if rope_dim % 2:
        raise _refuse(f"qk_rope_head_dim={rope_dim}: RoPE needs an even width")
    return MLAConfig(q_lora_rank=q_lora, kv_lora_rank=_positive_int(cfg, "kv_lora_rank", default=512),
                     qk_nope_head_dim=_positive_int(cfg, "qk_nope_head_dim", default=128),
                     qk_rope_head_dim=rope_dim, v_head_dim=_positive_int(cfg, "v_head_dim", default=128),
                     rope_interleave=_flag(cfg, "rope_interleave", True), softmax_scale=0.0)


def _with_softmax_scale(mla: MLAConfig, cfg: dict, rope: RopeConfig) -> MLAConfig:
    """HF's DeepseekV3Attention: (nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2
    when a scaled RoPE gives mscale_all_dim (yarn's attention temperature, applied to the
    logits as well as to cos/sin)."""
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if rope.rope_type != "default" and mscale_all_dim:
        factor = params.get("factor") or rope.factor
        if factor > 1:
            m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= m * m
    return MLAConfig(mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                     mla.v_head_dim, mla.rope_interleave, scale)


def read_rope_config(cfg: dict, max_position_embeddings: int) -> RopeConfig:
    """Both layouts: transformers>=5 `rope_parameters` and the older top-level `rope_theta` +
    `rope_scaling`. Where both are present they must agree; HF 5 would prefer one silently and
    HF 4 the other, so a disagreement has no single meaning."""
    new = cfg.get("rope_parameters")
    old = cfg.get("rope_scaling")
    for name, value in (("rope_parameters", new), ("rope_scaling", old)):
        if value is not None and not isinstance(value, dict):
            raise _refuse(f"{name}={value!r} must be an object")
    params = dict(new or old or {})
    if new and any(isinstance(v, dict) for v in new.values()):
        raise _refuse(f"rope_parameters nested by layer type ({', '.join(k for k, v in new.items() if isinstance(v, dict))})"
                      ": a different RoPE per layer type is not implemented")
    if new and old:
        for key, value in old.items():
            mine = params.get("rope_type" if key == "type" else key, params.get(key))
            if mine != value:
                raise _refuse(f"rope_scaling.{key}={value!r} disagrees with rope_parameters ({mine!r})")
    if "rope_theta" in cfg and cfg["rope_theta"] is not None:
        if "rope_theta" in params and params["rope_theta"] != cfg["rope_theta"]:
            raise _refuse(f"rope_theta={cfg['rope_theta']!r} disagrees with "
                          f"rope_parameters.rope_theta={params['rope_theta']!r}")
        params.setdefault("rope_theta", cfg["rope_theta"])
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if "rope_type" in params and "type" in params and params["rope_type"] != params["type"]:
        raise _refuse(f"rope type is both {params['rope_type']!r} (rope_type) and {params['type']!r} (type)")
    if rope_type not in ROPE_TYPES:
        raise _refuse(f"rope_type {rope_type!r} is not implemented (implemented: {', '.join(ROPE_TYPES)})")
    prf = params.get("partial_rotary_factor")
    if prf is not None and prf != 1:
        raise _refuse(f"rope_parameters.partial_rotary_factor={prf!r}: only rotating the whole head is implemented")
    if params.get("mrope_section"):
        raise _refuse("rope_parameters.mrope_section: multimodal RoPE is not implemented")
    unknown = sorted(set(params) - _HF_ROPE_KEYS)
    if unknown:
        logger.warning("rope parameters ignored (HF does not read them either): %s", ", ".join(unknown))
    unused = sorted(set(params) & _HF_ROPE_KEYS - ROPE_TYPES[rope_type]
                    - {"rope_theta", "rope_type", "type", "partial_rotary_factor", "mrope_section"})
    if unused:
        logger.warning("rope_type %r does not read %s; ignored as HF ignores it", rope_type, ", ".join(unused))
    theta = _number(params.get("rope_theta", 10000.0), "rope_theta")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = params.get("factor")
    if rope_type in ("linear", "dynamic", "llama3") or factor is not None:
        factor = _number(factor, "factor")
    if rope_type in ("linear", "dynamic"):
        return RopeConfig(rope_type, theta, factor,
                          original_max_position_embeddings=max_position_embeddings if rope_type == "dynamic" else None)
    original = _original_max_positions(cfg, params, max_position_embeddings)
    if rope_type == "llama3":
        return RopeConfig("llama3", theta, factor, original,
                          low_freq_factor=_number(params.get("low_freq_factor"), "low_freq_factor"),
                          high_freq_factor=_number(params.get("high_freq_factor"), "high_freq_factor"))
    return _yarn(params, theta, factor, original, max_position_embeddings)


def _yarn(params: dict, theta: float, factor: float | None, original: int, max_positions: int) -> RopeConfig:
    if factor is None:  # as HF: the ratio of the extended to the pretraining length
        factor = max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise _refuse(f"rope_parameters.truncate={truncate!r} must be true or false")
    return RopeConfig("yarn", theta, factor, original,
                      beta_fast=_number(params.get("beta_fast") or 32, "beta_fast"),
                      beta_slow=_number(params.get("beta_slow") or 1, "beta_slow"),
                      truncate=truncate, attention_factor=_number(attention_factor, "attention_factor"))


def _original_max_positions(cfg: dict, params: dict, max_position_embeddings: int) -> int:
    """HF's standardize_rope_params: a top-level original_max_position_embeddings wins over the
    rope dict's; without either, max_position_embeddings."""
    top, inner = cfg.get("original_max_position_embeddings"), params.get("original_max_position_embeddings")
    if top is not None and inner is not None and top != inner:
        raise _refuse(f"original_max_position_embeddings={top!r} disagrees with the rope dict's ({inner!r})")
    value = top if top is not None else inner if inner is not None else max_position_embeddings
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _refuse(f"original_max_position_embeddings={value!r} must be a positive integer")
    return value


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _refuse(f"rope {key}={value!r} must be a number" if value is not None
                      else f"rope parameters lack {key}")
    return float(value)


@dataclass(frozen=True)
class TPShard:
    """What one tensor-parallel rank holds of the model (Megatron-style).

    Query heads are split evenly. KV heads are split when tp <= num_kv_heads; past that each
    rank holds the one KV head its query heads read (heads replicated tp / num_kv_heads
    times, as `pagedserve plan` counts). The MLP's intermediate dimension is split evenly;
    the vocabulary is split into ceil(vocab / tp) rows per rank, the last rank's padded.
    Rank r's query heads [q_head_start, +num_heads) read exactly its KV heads
    [kv_head_start, +num_kv_heads): the GQA grouping survives the split.
    """

    tp: int
    rank: int
    num_heads: int
    q_head_start: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    intermediate_start: int
    vocab_per_rank: int
    vocab_start: int
    vocab_end: int          # exclusive, never past the real vocabulary
    # MoE: whole experts per rank (E / tp each) instead of 1/tp of every expert's intermediate dimension
    expert_parallel: bool = False
    # DP attention + EP (-dp with --enable-expert-parallel): this rank is data-parallel core
    # dp_rank of dp_size; everything but the routed experts is whole here, and the experts are
    # spread over the tp x dp_size ranks (vLLM's EP group), E / (tp x dp_size) each.
    dp_size: int = 1
    dp_rank: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig, tp: int = 1, rank: int = 0, expert_parallel: bool = False,
           dp_size: int = 1, dp_rank: int = 0) -> "TPShard":
        check_model_parallel(cfg, tp, expert_parallel)
        ep_over_dp = expert_parallel and cfg.moe is not None and dp_size > 1
        if ep_over_dp:
            check_data_parallel(cfg, tp * dp_size, expert_parallel)
        heads = cfg.num_heads // tp
        if tp <= cfg.num_kv_heads:
            kv_heads, kv_start = cfg.num_kv_heads // tp, rank * (cfg.num_kv_heads // tp)
        else:
            kv_heads, kv_start = 1, rank // (tp // cfg.num_kv_heads)
        inter = cfg.intermediate_size // tp
        vocab = -(-cfg.vocab_size // tp)
        start = rank * vocab
        return cls(tp, rank, heads, rank * heads, kv_heads, kv_start, inter, rank * inter, vocab, start,
                   min(start + vocab, cfg.vocab_size), expert_parallel and cfg.moe is not None,
                   dp_size if ep_over_dp else 1, dp_rank if ep_over_dp else 0)

    @property
    def ep_size(self) -> int:
        """Ranks the routed experts are spread over (1: every rank holds a share of each)."""
        return self.tp * self.dp_size if self.expert_parallel else 1

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[first, end) of the routed experts this rank holds: all of them without EP."""
        if self.ep_size == 1:
            return 0, num_experts
        per_rank = num_experts // self.ep_size
        ep_rank = self.dp_rank * self.tp + self.rank
        return ep_rank * per_rank, (ep_rank + 1) * per_rank

    def expert_intermediate_range(self, intermediate_size: int) -> tuple[int, int]:
        """(start, size) of each held expert's intermediate dimension: whole under EP."""
        if self.expert_parallel or self.tp == 1:
            return 0, intermediate_size
        size = intermediate_size // self.tp
        return self.rank * size, size

    def shared_intermediate_range(self, intermediate_size: int) -> tuple[int, int]:
        """(start, size) of the shared experts' intermediate dimension: sharded like a dense MLP, EP or not."""
        size = intermediate_size // self.tp
        return self.rank * size, size


def check_model_parallel(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """Refuse, with the numbers, a layout the model cannot be split by: heads and the dense
    MLP as `check_tensor_parallel`; an MoE model's experts (split by their intermediate
    dimension, or whole under expert parallelism) and its shared experts."""
    moe = cfg.moe
    if expert_parallel and moe is None:
        raise ValueError(f"enable_expert_parallel: {cfg.architecture} has no experts to spread")
    has_dense_mlp = moe is None or not all(moe.sparse_layers)
    # Mixtral's intermediate_size is its experts' (it has no dense MLP): checked below, by the EP rule
    check_tensor_parallel(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size if has_dense_mlp else 0, tp)
    if moe is None or tp == 1:
        return
    if expert_parallel and moe.num_experts % tp:
        raise ValueError(f"enable_expert_parallel: the expert-parallel size {tp} (= tensor_parallel_size) does not "
                         f"divide the model's {moe.num_experts} experts; use a divisor of {moe.num_experts}")
    if not expert_parallel and moe.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide the experts' intermediate size "
                         f"{moe.intermediate_size} (each expert is split by it without --enable-expert-parallel)")
    if moe.shared_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide the shared experts' intermediate size "
                         f"{moe.shared_intermediate_size}")


def check_data_parallel(cfg: ModelConfig, dp: int, expert_parallel: bool = False) -> None:
    """Refuse, with the numbers, DP attention + EP (-dp with --enable-expert-parallel) the
    model's experts cannot be spread by: whole experts on each of the dp cores."""
    if dp == 1 or not expert_parallel or cfg.moe is None:
        return
    if cfg.moe.num_experts % dp:
        raise ValueError(f"enable_expert_parallel: the expert-parallel size {dp} (= data_parallel_size) does not "
                         f"divide the model's {cfg.moe.num_experts} experts; use a divisor of {cfg.moe.num_experts}")


def check_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int, tp: int) -> None:
    """Refuse, with the numbers, a tensor_parallel_size the model cannot be split by."""
    if tp == 1:
        return
    if num_heads % tp:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide the model's {num_heads} attention heads; "
                         f"use a divisor of {num_heads}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size: {tp} neither divides the model's {num_kv_heads} KV heads nor is "
                         f"a multiple of them (each rank needs whole KV heads)")
    if intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide the model's intermediate_size "
                         f"{intermediate_size}")
