"""Llama-family decoder (Llama, Qwen2 with qkv bias, Mistral) over a paged KV cache.

Tensors are flat over the step's tokens ([T, hidden]); the attention backend knows which
tokens belong to which request. q/k/v and gate/up projections are fused at load time so
each layer runs two GEMMs fewer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention import AttentionMetadata, paged_attention
from pagedserve.model.config import ModelConfig
from pagedserve.model.layers import Linear
from pagedserve.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, k_cache, v_cache, meta):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    # -- loading ----------------------------------------------------------------------
    def load_checkpoint(self, tensors) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        q, kv = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
        inter = self.cfg.intermediate_size
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
            with torch.no_grad():
                if offset is None:
                    param.copy_(tensor)
                else:
                    param[offset:offset + size].copy_(tensor)
            loaded.add(target if offset is None else f"{target}[{offset}]")
        missing = [n for n in params if n not in loaded and not any(k.startswith(n + "[") for k in loaded)]
        if missing:
            raise ValueError(f"model: checkpoint is missing tensors: {missing[:5]}{'...' if len(missing) > 5 else ''}")

    def init_buffers(self, device) -> None:
        self.rotary = RotaryEmbedding(self.cfg.rope, self.cfg.head_dim, self.embed_tokens.weight.dtype, device)

    # -- forward ----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, prompt_lens: torch.Tensor | None = None) -> torch.Tensor:
        """kv_cache: [layers, 2, num_slots, kv_heads, head_dim]. prompt_lens: [T], each token's
        request prompt length, read only when `self.rotary.needs_prompt_lens` (dynamic NTK RoPE).
        Returns hidden [T, H]."""
        h = self.embed_tokens(input_ids)
        # computed per step rather than cached per position: cheap next to one layer, and
        # no table of max_position_embeddings rows (128 MB for a 128k-context model)
        cos, sin = self.rotary(positions, prompt_lens)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache[i, 0], kv_cache[i, 1], meta)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding table is the head, kept plain for the lookup
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
