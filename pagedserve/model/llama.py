"""Llama-family decoder (Llama, Qwen2 with qkv bias, Mistral) over a paged KV cache.

Tensors are flat over the step's tokens ([T, hidden]); the attention backend knows which
tokens belong to which request. q/k/v and gate/up projections are fused at load time so
each layer runs two GEMMs fewer. Under tensor parallelism each rank builds the model with
its TPShard's head and row counts and loads its slices of the checkpoint (model/parallel.py);
with tp == 1 the shard is the whole model.

The residual stream is carried beside each layer's output (DecoderLayer.forward returns the
MLP output and the residual it has not yet been added to), so that each residual add and the
norm after it are one op: model/cpu/fused.py runs the norms, the add + norm, RoPE and SiLU * up
as single C++ calls on CPU, or as the torch reference expressions (same rounding) elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention import AttentionMetadata, paged_attention
from pagedserve.model.config import ModelConfig, TPShard
from pagedserve.model.cpu import fused
from pagedserve.model.cpu.fused import rotate_half  # noqa: F401 (deepseek.py imports it from here)
from pagedserve.model.layers import Linear
from pagedserve.model.parallel import (RowParallelLinear, VocabParallelEmbedding, gather_vocab_logits,
                                       shard_checkpoint_tensor)
from pagedserve.model.rope import RotaryEmbedding
from pagedserve.scratch import ScratchOutput


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.scratch: ScratchOutput | None = None  # a decoder layer's norms: their output is read within it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self._parameters["weight"], self.eps, self.scratch)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); `residual` may be updated in place."""
        return fused.add_rms_norm(x, residual, self._parameters["weight"], self.eps, self.scratch)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        self.q_size = shard.num_heads * cfg.head_dim
        self.kv_size = shard.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, shard.tp)
        self.scale = self.head_dim ** -0.5
        self.head_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]  # qkv's heads: q, k, v
        # q/k/v, the attention output and o_proj's are read within the layer only (pagedserve/scratch.py)
        self.qkv_proj.scratch, self.o_proj.scratch = ScratchOutput(), ScratchOutput()
        self.attn_scratch = ScratchOutput()

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        modules = self._modules
        qkv = modules["qkv_proj"].forward(x)
        rows = qkv.shape[0]
        # q, k, v as views of the qkv rows: [T, heads, D] each with the qkv row stride
        q, k, v = qkv.view(rows, -1, self.head_dim).split_with_sizes(self.head_split, 1)
        q, k = fused.apply_rotary(q, k, cos, sin)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, scratch=self.attn_scratch)
        return modules["o_proj"].forward(o.reshape(rows, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        self.inter = shard.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(self.inter, cfg.hidden_size, cfg.mlp_bias, shard.tp)
        # gate/up and SiLU * up are read within the MLP; its output (the layer's) is a new tensor
        self.gate_up_proj.scratch, self.silu_scratch = ScratchOutput(), ScratchOutput()

    def forward(self, x):
        modules = self._modules
        return modules["down_proj"].forward(fused.silu_and_mul(modules["gate_up_proj"].forward(x), self.silu_scratch))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard)
        self.input_layernorm.scratch = ScratchOutput()
        self.post_attention_layernorm.scratch = ScratchOutput()

    def forward(self, h, residual, cos, sin, k_cache, v_cache, meta):
        """h: the previous layer's MLP output, not yet added to `residual` (the first layer: the
        embeddings, residual None). Returns (this layer's MLP output, the residual before it):
        the unfused `h = h + attn(norm(h)); h = h + mlp(norm(h))` with each add moved into the
        next norm."""
        # Submodules from _modules and their forward called directly: nn.Module.__getattr__ and
        # __call__ (hooks, which this model never registers) cost ~0.6 and ~1.8 us a time, and
        # a decode step on a small model is a few hundred such calls.
        modules = self._modules
        if residual is None:
            residual, x = h, modules["input_layernorm"].forward(h)
        else:
            x, residual = modules["input_layernorm"].add_and_norm(h, residual)
        attn = modules["self_attn"].forward(x, cos, sin, k_cache, v_cache, meta)
        x, residual = modules["post_attention_layernorm"].add_and_norm(attn, residual)
        return modules["mlp"].forward(x), residual


class LlamaForCausalLM(nn.Module):
    # Tensors a pipeline stage hands the next: the layer output and the residual (model/pipeline.py).
    num_intermediate_tensors = 2
    # The whole forward in one C++ call where every piece already runs in pagedserve's C++
    # (model/cpu/decoder.py; set by model/loader.py once the weights are packed); None: op by op.
    native_forward = None

    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard = shard or TPShard.of(cfg)
        self.embed_tokens = VocabParallelEmbedding(shard, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, shard.vocab_per_rank, bias=False))

    # -- loading ----------------------------------------------------------------------
    def load_checkpoint(self, tensors) -> None:
        """Copy HF-named tensors in (this rank's slices of them), fusing q/k/v and gate/up as
        they arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shard = self.shard
        q, kv = shard.num_heads * self.cfg.head_dim, shard.num_kv_heads * self.cfg.head_dim
        inter = shard.intermediate_size
        fused = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
                 "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter)}
        for name, tensor in tensors:
            if name.startswith("model."):
                name = name[len("model."):]
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            parts = name.split(".")
            target, offset, size = name, None, None
            if len(parts) >= 2 and parts[-2] in fused:
                new, offset, size = fused[parts[-2]]
                target = ".".join(parts[:-2] + [new, parts[-1]])
            if target not in params:
                raise ValueError(f"model: unexpected tensor {name!r} in checkpoint")
            param = params[target]
            tensor = shard_checkpoint_tensor(name, tensor, self.cfg, shard)
            with torch.no_grad():
                if offset is None:
                    param.copy_(tensor)
                else:
                    param[offset:offset + size].copy_(tensor)
            loaded.add(target if offset is None else f"{target}[{offset}]")
        missing = [n for n in params if n not in loaded and not any(k.startswith(n + "[") for k in loaded)]
        if missing:
            raise ValueError(f"model: checkpoint is missing tensors: {missing[:5]}{'...' if len(missing) > 5 else ''}")

    def init_buffers(self, device, max_model_len: int | None = None) -> None:
        """`max_model_len`: the engine's; RoPE tables cos/sin for positions below it (None:
        computed per step)."""
        dtype = next(self.parameters()).dtype  # a middle pipeline stage has no embedding
        self.rotary = RotaryEmbedding(self.cfg.rope, self.cfg.head_dim, dtype, device, max_model_len)

    # -- forward ----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, prompt_lens: torch.Tensor | None = None,
                intermediate: tuple | None = None) -> torch.Tensor | tuple:
        """kv_cache: [layers, 2, num_slots, kv_heads, head_dim]. prompt_lens: [T], each token's
        request prompt length, read only when `self.rotary.needs_prompt_lens` (dynamic NTK RoPE).
        Returns hidden [T, H]. A pipeline stage after the first starts from `intermediate`
        (the previous stage's (h, residual)); one before the last (no final norm) returns
        its (h, residual) instead of the normed hidden."""
        native = self.__dict__.get("native_forward")
        if native is not None and intermediate is None:
            hidden = native.forward(input_ids, positions, kv_cache, meta, prompt_lens)
            if hidden is not None:  # else this step needs the per-op path (decoder.py says when)
                return hidden
        modules = self._modules  # as DecoderLayer.forward: no Module.__getattr__ / __call__ per layer
        if intermediate is None:
            h, residual = modules["embed_tokens"].forward(input_ids), None
        else:
            h, residual = intermediate
        # rows of a table of max_model_len positions, or computed per step (model/rope.py)
        cos, sin = self.rotary(positions, prompt_lens)
        for layer, (k_cache, v_cache) in zip(modules["layers"], self._layer_caches(kv_cache)):
            h, residual = layer.forward(h, residual, cos, sin, k_cache, v_cache, meta)
        norm = modules.get("norm")
        if norm is None:  # not the last pipeline stage
            return h, residual
        return norm.forward(h) if residual is None else norm.add_and_norm(h, residual)[0]

    def _layer_caches(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (K, V) views of the pool, made once per pool tensor: indexing them
        afresh was 2 x layers select ops in every step (the pool is allocated once)."""
        views = self.__dict__.get("_kv_views")
        if views is None or views[0] is not kv_cache:
            views = self.__dict__["_kv_views"] = (kv_cache, [(kv_cache[i, 0], kv_cache[i, 1])
                                                             for i in range(len(self.layers))])
        return views[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits over the whole vocabulary; under TP every rank must call this (it
        gathers its vocabulary slice to rank 0), and only rank 0 gets the logits (None elsewhere)."""
        if self.lm_head is None:  # tied: the embedding table is the head, kept plain for the lookup
            local = F.linear(hidden, self.embed_tokens.weight)
        else:
            local = self.lm_head.forward(hidden)
        if local.dtype != torch.float32:
            local = local.float()
        return gather_vocab_logits(local, self.shard, self.cfg.vocab_size)
