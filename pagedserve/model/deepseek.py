"""DeepSeek-V3: multi-head latent attention over a latent paged cache, and an MoE with
shared experts after `first_k_dense_replace` dense layers.

Per layer and token the KV pool stores kv_lora_rank + qk_rope_head_dim values (the normed
latent and the rotated rope key): `ModelConfig.kv_cache_shape` and plan's MLA bytes per
token agree by construction. Attention is attention/mla.py's (decodes absorbed into latent
space, prompt chunks expanded; that module says why). RoPE: HF rotates interleaved pairs
when rope_interleave; the rope rows of q_b_proj (or q_proj) and kv_a_proj_with_mqa are
de-interleaved at load ([x0, x2, ..., x1, x3, ...]), after which rotating halves, as Llama
does, rotates exactly HF's pairs and lays the result out as HF does.

Tensor parallelism: query heads split over the ranks, the latent replicated (MLAttention
says how); the MoE layers as model/moe.py; dense MLPs, embedding and head as Llama's.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention import torch_backend
from pagedserve.attention.mla import mla_attention
from pagedserve.attention.torch_backend import AttentionMetadata
from pagedserve.model.config import ModelConfig, TPShard
from pagedserve.model.layers import Linear
from pagedserve.model.llama import RMSNorm, rotate_half
from pagedserve.model.moe import DenseMLP, SparseMoeBlock
from pagedserve.model.moe_models import expert_placement, llama_placement, shared_expert_placement, tp_sliced
from pagedserve.model.parallel import (RowParallelLinear, VocabParallelEmbedding, gather_vocab_logits, moe_combine,
                                       shard_heads)
from pagedserve.model.rope import RotaryEmbedding
from pagedserve.model.weights import Placement, load_tensors

_LAYER = re.compile(r"^layers\.(\d+)\.")


def deinterleave_rows(width: int, group: int, rope: int) -> torch.Tensor:
    """Row order that de-interleaves the last `rope` rows of every `group`-row group of a
    `width`-row weight: even rows of the rope part first, then odd ones."""
    order = torch.arange(width)
    for start in range(0, width, group):
        lo = start + group - rope
        part = order[lo:start + group].clone()
        order[lo:start + group] = torch.cat([part[0::2], part[1::2]])
    return order


class MLAttention(nn.Module):
    """MLA over this rank's query heads (`shard.num_heads`): q_b_proj (or q_proj) and
    kv_b_proj hold those heads' rows, o_proj their columns (row-parallel, one all-reduce);
    q_a_proj and kv_a_proj_with_mqa are replicated, so every rank computes, writes and
    reads the whole latent: its KV pool is the full latent cache."""

    def __init__(self, cfg: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        mla, h = cfg.mla, cfg.hidden_size
        self.mla, self.num_heads = mla, shard.num_heads
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        bias = cfg.o_proj_bias  # attention_bias: q_a, kv_a and o carry a bias
        if mla.q_lora_rank is None:
            self.q_proj = Linear(h, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(h, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(mla.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        # kept a plain parameter: attention reads its weight as the per-head W_k / W_v
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                   bias=False)
        self.o_proj = RowParallelLinear(self.num_heads * mla.v_head_dim, h, bias, shard.tp)

    def forward(self, x, cos, sin, cache, meta: AttentionMetadata):
        mla = self.mla
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, self.num_heads, self.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope = q_rope * cos + rotate_half(q_rope) * sin
        k_rope = k_rope * cos[:, 0] + rotate_half(k_rope) * sin[:, 0]
        o = mla_attention(q_nope, q_rope, latent, k_rope, cache, self.kv_b_proj.weight, mla.qk_nope_head_dim,
                          meta, mla.softmax_scale)
        return self.o_proj(o.reshape(-1, self.num_heads * mla.v_head_dim))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sparse: bool, shard: TPShard) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (SparseMoeBlock(cfg.hidden_size, cfg.moe, shard, moe_combine) if sparse
                    else DenseMLP(cfg.hidden_size, shard.intermediate_size, shard.tp))

    def forward(self, h, cos, sin, cache, meta):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV3ForCausalLM(nn.Module):
    num_intermediate_tensors = 1  # a pipeline stage hands on h alone (no separate residual)
    # The runner builds this model's attention metadata with the torch reference backend
    # (the compiled CPU kernel reads GQA pools only); its latent pool is never quantized.
    @staticmethod
    def build_metadata(decodes, prefills, block_size: int, sliding_window: int | None, device,
                       quantized_cache: bool = False):
        if quantized_cache:
            raise ValueError("kv_cache_dtype: a quantized cache is not implemented for the MLA latent cache")
        return torch_backend.build_metadata(decodes, prefills, block_size, sliding_window, device)

    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard = shard or TPShard.of(cfg)
        self.embed_tokens = VocabParallelEmbedding(shard, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, sparse, shard) for sparse in cfg.moe.sparse_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, shard.vocab_per_rank, bias=False)

    def load_checkpoint(self, tensors) -> None:
        cfg, mla, shard = self.cfg, self.cfg.mla, self.shard
        self._keep_router_fp32()
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        rope = mla.qk_rope_head_dim
        q_order = kv_order = None
        if mla.rope_interleave:
            q_order = deinterleave_rows(cfg.num_heads * qk, qk, rope)
            kv_order = deinterleave_rows(mla.kv_lora_rank + rope, mla.kv_lora_rank + rope, rope)
        shared = cfg.moe.shared_intermediate_size

        def rows(order, head_width):
            """De-interleave the whole tensor's rope rows (when HF interleaves), then keep
            this rank's heads' rows (`head_width` rows each; None: replicated)."""
            def transform(t):
                if order is not None:
                    t = t.index_select(0, order)
                return t if head_width is None or shard.tp == 1 else shard_heads(t, shard, head_width)
            return None if order is None and (head_width is None or shard.tp == 1) else transform

        def resolve(name: str) -> Placement | None:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                return None
            m = _LAYER.match(name)
            if m is not None and int(m.group(1)) >= cfg.num_layers:
                return None  # the multi-token-prediction layer: HF skips it too
            place = expert_placement(name, cfg, shard)
            if place is not False:
                return place
            if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
                return Placement(name, transform=rows(q_order, qk))
            if name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
                return Placement(name, transform=rows(kv_order, None))   # the latent: replicated
            if name.endswith("self_attn.kv_b_proj.weight"):
                return Placement(name, transform=rows(None, mla.qk_nope_head_dim + mla.v_head_dim))
            if name.endswith("self_attn.o_proj.weight") and shard.tp > 1:
                return Placement(name, transform=lambda t: shard_heads(t, shard, mla.v_head_dim, dim=1))
            if ".self_attn." in name:
                return Placement(name)   # q_a_proj, the norms, o_proj's bias (added once): replicated
            if ".shared_experts." in name and not shared:
                return None  # n_shared_experts = 0: HF's shared MLP is zero-width and adds 0
            if ".shared_experts." in name:
                return shared_expert_placement(name.replace(".shared_experts.", ".shared_expert."), shared, shard)
            inter = shard.intermediate_size
            return tp_sliced(name, llama_placement(name, cfg, {"gate_proj": inter, "up_proj": inter}), cfg, shard)

        load_tensors(self, tensors, resolve)

    def _keep_router_fp32(self) -> None:
        """HF keeps the router weight and correction bias in fp32 whatever the model dtype."""
        for module in self.modules():
            if isinstance(module, SparseMoeBlock):
                for name, param in module.gate.named_parameters():
                    if param.dtype != torch.float32:
                        setattr(module.gate, name, nn.Parameter(param.data.float(), requires_grad=False))

    def init_buffers(self, device, max_model_len: int | None = None) -> None:
        self.rotary = RotaryEmbedding(self.cfg.rope, self.cfg.mla.qk_rope_head_dim,
                                      next(self.parameters()).dtype, device, max_model_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, prompt_lens: torch.Tensor | None = None,
                intermediate: tuple | None = None) -> torch.Tensor | tuple:
        """kv_cache: [layers, 1, num_slots, 1, kv_lora_rank + qk_rope_head_dim]. Pipeline
        stages: as LlamaForCausalLM.forward, with (h, None) between stages."""
        h = self.embed_tokens(input_ids) if intermediate is None else intermediate[0]
        cos, sin = self.rotary(positions, prompt_lens)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache[i, 0], meta)
        return (h, None) if self.norm is None else self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """As LlamaForCausalLM's: vocabulary-parallel, the full logits on rank 0 only."""
        if self.lm_head is None:
            local = F.linear(hidden, self.embed_tokens.weight).float()
        else:
            local = self.lm_head(hidden).float()
        return gather_vocab_logits(local, self.shard, self.cfg.vocab_size)
