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
from pagedserve.model.pipeline import PipelineStage, prune_model, stage_config, stage_tensors

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


def model_class(config: ModelConfig):
    """Llama, Qwen2 and Mistral run on LlamaForCausalLM (config says how they differ);
    Mixtral and Qwen2-MoE on its MoE variant; DeepSeek-V3 on its own (MLA)."""
    if config.mla is not None:
        from pagedserve.model.deepseek import DeepseekV3ForCausalLM
        return DeepseekV3ForCausalLM
    if config.moe is not None:
        from pagedserve.model.moe_models import MoeForCausalLM
        return MoeForCausalLM
    return LlamaForCausalLM


def load_model(config: ModelConfig, dtype: str, device: str, shard: TPShard | None = None,
               stage: PipelineStage | None = None, max_model_len: int | None = None,
               **model_kwargs) -> LlamaForCausalLM:
    """Build the architecture's model on `device` in `dtype` and load its weights.
    `shard`: the tensor-parallel rank's share (default: the whole model), experts included
    (model.config.TPShard: sliced by their intermediate dimension, or whole under EP).
    `stage`: the pipeline stage's layers (default: all; model/pipeline.py): the model is
    built for those layers only and reads only their tensors (and the embedding, norm and
    head where the stage holds them). `max_model_len`: the engine's resolved limit, the
    positions the RoPE table covers (None: no table, cos/sin computed every step)."""
    torch_dtype = TORCH_DTYPES[dtype]
    stage = stage or PipelineStage.of(config.num_layers)
    config = stage_config(config, stage)
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config, shard, **model_kwargs)
    prune_model(model, stage, config.tie_word_embeddings)
    model = model.to_empty(device=device).to(torch_dtype)
    model.load_checkpoint(stage_tensors(iter_checkpoint_tensors(config.path), stage, config.tie_word_embeddings))
    # what this rank holds, counted before packing changes any weight's storage (plan counts the same)
    model.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.init_buffers(device, max_model_len)
    model.eval()
    prepare_linear_layers(model, torch_dtype, torch.device(device))
    if isinstance(model, LlamaForCausalLM):
        # whether the forward runs as one native call (decided here, not in llama.py: decoder.py reads
        # llama.py's layer classes, so llama.py importing it back would close a circle)
        from pagedserve.model.cpu.decoder import NativeForward
        model.native_forward = NativeForward.build(model)
    return model
