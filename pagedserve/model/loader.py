"""Load a local HF checkpoint directory: config.json + *.safetensors (sharded or not)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

logger = logging.getLogger("pagedserve.model")

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None
    checkpoint_dtype: str

    @property
    def name(self) -> str:
        return self.hf_config.get("_name_or_path") or self.path.name


def read_model_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"model: {str(path)!r} is not a model directory (no config.json there); "
                         "pass a local HF checkpoint directory")
    cfg = json.loads(cfg_file.read_text())
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"model: architecture {archs or '(none given)'} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    heads = cfg["num_attention_heads"]
    sliding = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        sliding = None
    return ModelConfig(
        path=path,
        architecture=arch,
        hf_config=cfg,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", 10000.0),
        rope_scaling=cfg.get("rope_scaling"),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        sliding_window=sliding,
        checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype") or "float32",
    )


def iter_checkpoint_tensors(path: Path):
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {str(path)!r}")
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def load_model(config: ModelConfig, dtype: str, device: str):
    from pagedserve.model.layers import prepare_linear_layers
    from pagedserve.model.llama import LlamaForCausalLM

    torch_dtype = TORCH_DTYPES[dtype]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(torch_dtype)
    model.load_checkpoint(iter_checkpoint_tensors(config.path))
    model.init_buffers(device)
    model.eval()
    prepare_linear_layers(model, torch_dtype, torch.device(device))
    return model
