"""Load a local HF checkpoint directory: config.json + *.safetensors (sharded or not).

Reading config.json (and refusing what the model code cannot run) lives in model/config.py;
this module builds the model and copies the weights in.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, TPShard, read_model_config
from pagedserve.model.layers import prepare_linear_layers
from pagedserve.model.llama import LlamaForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "TORCH_DTYPES", "ModelConfig", "iter_checkpoint_tensors", "load_model",
           "read_model_config"]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def load_model(config: ModelConfig, dtype: str, device: str, shard: TPShard | None = None) -> LlamaForCausalLM:
    """All three supported architectures run on LlamaForCausalLM; config says how they differ.
    `shard`: the tensor-parallel rank's share (default: the whole model)."""
    torch_dtype = TORCH_DTYPES[dtype]
    with torch.device("meta"):
        model = LlamaForCausalLM(config, shard)
    model = model.to_empty(device=device).to(torch_dtype)
    model.load_checkpoint(iter_checkpoint_tensors(config.path))
    model.init_buffers(device)
    model.eval()
    prepare_linear_layers(model, torch_dtype, torch.device(device))
    return model
