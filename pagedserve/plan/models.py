"""Model memory facts: shapes from a local config.json or a preset, parameter counts, weight bytes.

Presets hold the decoder fields of each model's published HF `config.json`, so a preset
and a local config go through the very same `ModelShape.from_hf_config`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .kv_budget import ModelShape, dtype_bytes

# Decoder fields copied from the published config.json of each model on the HF hub.
MODEL_PRESETS: dict[str, dict] = {
    "llama-3.1-8b": {  # meta-llama/Llama-3.1-8B
        "model_type": "llama", "hf_name": "meta-llama/Llama-3.1-8B",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "llama-3.1-70b": {  # meta-llama/Llama-3.1-70B
        "model_type": "llama", "hf_name": "meta-llama/Llama-3.1-70B",
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {  # Qwen/Qwen2.5-7B-Instruct
        "model_type": "qwen2", "hf_name": "Qwen/Qwen2.5-7B-Instruct",
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "qwen2.5-72b": {  # Qwen/Qwen2.5-72B-Instruct
        "model_type": "qwen2", "hf_name": "Qwen/Qwen2.5-72B-Instruct",
        "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "mistral-7b": {  # mistralai/Mistral-7B-Instruct-v0.3
        "model_type": "mistral", "hf_name": "mistralai/Mistral-7B-Instruct-v0.3",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32768,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1
        "model_type": "mixtral", "hf_name": "mistralai/Mixtral-8x7B-v0.1",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "num_local_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "deepseek-v3": {  # deepseek-ai/DeepSeek-V3 (the MTP layer, num_nextn_predict_layers=1, is not counted)
        "model_type": "deepseek_v3", "hf_name": "deepseek-ai/DeepSeek-V3",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "vocab_size": 129280, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "max_position_embeddings": 163840, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        # The published checkpoint stores its linear layers in fp8 (e4m3, block-scaled).
        "quantization_config": {"quant_method": "fp8"},
    },
}

# Short spellings people type.
_ALIASES = {
    "llama3.1-8b": "llama-3.1-8b", "llama-3-8b": "llama-3.1-8b", "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b", "meta-llama/meta-llama-3-8b": "llama-3.1-8b",
    "llama3.1-70b": "llama-3.1-70b", "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "qwen2.5-7b-instruct": "qwen2.5-7b", "qwen/qwen2.5-7b-instruct": "qwen2.5-7b", "qwen/qwen2.5-7b": "qwen2.5-7b",
    "qwen2.5-72b-instruct": "qwen2.5-72b", "qwen/qwen2.5-72b-instruct": "qwen2.5-72b", "qwen/qwen2.5-72b": "qwen2.5-72b",
    "mistral-7b-instruct-v0.3": "mistral-7b", "mistralai/mistral-7b-instruct-v0.3": "mistral-7b",
    "mistralai/mistral-7b-v0.3": "mistral-7b",
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b", "mistralai/mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
    "mixtral-8x7b-instruct": "mixtral-8x7b",
    "deepseek-ai/deepseek-v3": "deepseek-v3", "deepseek-r1": "deepseek-v3", "deepseek-ai/deepseek-r1": "deepseek-v3",
}


@dataclass(frozen=True)
class ModelInfo:
    """A model the planner can size: its name, shape and the dtype its checkpoint ships in."""

    name: str
    shape: ModelShape
    checkpoint_dtype: str = "bfloat16"
    source: str = "preset"  # "preset", a config.json path, or "generic"


def preset_names() -> list[str]:
    return sorted(MODEL_PRESETS)


def _checkpoint_dtype(cfg: dict) -> str:
    quant = (cfg.get("quantization_config") or {}).get("quant_method", "")
    if quant == "fp8":
        return "fp8"
    if quant in ("awq", "gptq", "awq_marlin", "gptq_marlin") and cfg["quantization_config"].get("bits") == 4:
        return "int4"
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return dtype if dtype in ("float32", "float16", "bfloat16") else "bfloat16"


def model_from_hf_config(cfg: dict, name: str, source: str) -> ModelInfo:
    return ModelInfo(name=name, shape=ModelShape.from_hf_config(cfg),
                     checkpoint_dtype=_checkpoint_dtype(cfg), source=source)


def load_model(model: str) -> ModelInfo:
    """`model` is a preset name, a directory holding config.json, or a config.json path.

    Raises ValueError (with the known presets listed) when it is none of these.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{path} does not hold a JSON object")
        return model_from_hf_config(cfg, name=str(path.parent.name or path), source=str(path))
    key = model.strip().lower()
    key = _ALIASES.get(key, key)
    if key in MODEL_PRESETS:
        return model_from_hf_config(MODEL_PRESETS[key], name=key, source="preset")
    raise ValueError(
        f"unknown model {model!r}: not a directory with config.json, not a config.json file, "
        f"and not a preset (presets: {', '.join(preset_names())})"
    )


def generic_model(
    *, num_layers: int, hidden_size: int | None = None, num_heads: int | None = None,
    num_kv_heads: int | None = None, head_dim: int | None = None,
    intermediate_size: int | None = None, vocab_size: int | None = None,
) -> ModelInfo:
    """A dense Llama-like decoder from hand-given numbers (`--layers 60 --kv-heads 32 --head-dim 128`).

    Missing pieces are derived: hidden = heads x head_dim, heads = kv_heads (MHA),
    head_dim = hidden / heads (128 when only the hidden size is given), intermediate = 4 x hidden (the classic MLP ratio),
    vocab = 32000. Only the KV arithmetic needs layers, kv heads and head_dim.
    """
    if num_heads is None and num_kv_heads is None and hidden_size and head_dim is None:
        # Only the hidden size is known: MHA with the usual 128-wide heads. For the KV
        # bytes the split does not matter (kv_heads x head_dim = hidden either way).
        head_dim = 128 if hidden_size % 128 == 0 else hidden_size
    if num_heads is None:
        num_heads = num_kv_heads or (hidden_size // head_dim if hidden_size and head_dim else None)
    if num_heads is None:
        raise ValueError("--heads (or --kv-heads, or --hidden-size) is required with --layers")
    if head_dim is None:
        if not hidden_size:
            raise ValueError("--head-dim or --hidden-size is required with --layers")
        head_dim = hidden_size // num_heads
    hidden_size = hidden_size or num_heads * head_dim
    shape = ModelShape(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_heads,
        num_kv_heads=num_kv_heads or num_heads, head_dim=head_dim,
        intermediate_size=intermediate_size if intermediate_size is not None else 4 * hidden_size,
        vocab_size=vocab_size if vocab_size is not None else 32000,
    )
    return ModelInfo(name="generic", shape=shape, checkpoint_dtype="bfloat16", source="generic")


def param_breakdown(shape: ModelShape) -> dict[str, int]:
    """Parameter counts by part: embedding, lm_head, attention, mlp (incl. MoE router), norms.

    Dense MLP is SwiGLU (gate, up, down = 3 x hidden x intermediate). MoE layers hold
    `num_experts` routed experts + shared experts + a router of hidden x num_experts.
    MLA attention: q (LoRA'd when q_lora_rank is set), kv_a (latent + rope key), kv_b, o.
    """
    h = shape.hidden_size
    if shape.is_mla:
        nope = shape.qk_nope_head_dim or 0
        rope = shape.qk_rope_head_dim or 0
        v_dim = shape.v_head_dim or shape.head_dim
        q_width = shape.num_attention_heads * (nope + rope)
        if shape.q_lora_rank:
            q = h * shape.q_lora_rank + shape.q_lora_rank + shape.q_lora_rank * q_width
        else:
            q = h * q_width
        kv = h * (shape.kv_lora_rank + rope) + shape.kv_lora_rank \
            + shape.kv_lora_rank * shape.num_attention_heads * (nope + v_dim)
        o = shape.num_attention_heads * v_dim * h
        attn_per_layer = q + kv + o
    else:
        q_width = shape.num_attention_heads * shape.head_dim
        kv_width = shape.num_kv_heads * shape.head_dim
        attn_per_layer = h * q_width + 2 * h * kv_width + q_width * h
        if shape.attention_bias:
            attn_per_layer += q_width + 2 * kv_width
    dense_mlp = 3 * h * shape.intermediate_size
    if shape.is_moe:
        moe_mlp = (3 * h * shape.moe_intermediate_size * shape.num_experts
                   + 3 * h * shape.shared_expert_intermediate_size + h * shape.num_experts
                   + h * shape.shared_expert_gate + shape.num_experts * shape.router_bias)
        num_dense = shape.first_dense_layers
        mlp = num_dense * dense_mlp + (shape.num_layers - num_dense) * moe_mlp
    else:
        mlp = shape.num_layers * dense_mlp
    embedding = shape.vocab_size * h
    return {
        "embedding": embedding,
        "lm_head": 0 if shape.tie_word_embeddings else embedding,
        "attention": shape.num_layers * attn_per_layer,
        "mlp": mlp,
        "norms": shape.num_layers * 2 * h + h,
    }


def param_count(shape: ModelShape) -> int:
    return sum(param_breakdown(shape).values())


def weight_bytes(shape: ModelShape, dtype: str) -> int:
    """Bytes of all weights (all TP ranks together) with linear layers stored in `dtype`.

    fp8 / int4 quantize only the decoder's linear layers, as vLLM does: embeddings,
    lm_head and norms stay 16-bit. int4 ignores its per-group scales (~3%).
    """
    parts = param_breakdown(shape)
    linear_bytes = dtype_bytes(dtype)
    if linear_bytes >= 2:
        return int(sum(parts.values()) * linear_bytes)
    linear = parts["attention"] + parts["mlp"]
    rest = parts["embedding"] + parts["lm_head"] + parts["norms"]
    return int(linear * linear_bytes + rest * 2)
