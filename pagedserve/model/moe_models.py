"""Mixtral and Qwen2-MoE: the Llama decoder with a mixture-of-experts MLP.

Attention, norms, embedding and head are Llama's (model/llama.py); only the MLP of the
sparse layers differs (model/moe.py), and Qwen2-MoE's dense layers keep Llama's fused
MLP. Checkpoint names are the hub's: Mixtral `block_sparse_moe.{gate, experts.E.w1/w2/w3}`,
Qwen2-MoE `mlp.{gate, experts.E.{gate,up,down}_proj, shared_expert.*, shared_expert_gate}`;
each expert's gate and up rows are stacked into one [E, 2I, H] tensor at load. Under
tensor parallelism each rank loads its slices (model/parallel.py; experts: model/moe.py).
"""
from __future__ import annotations

import re

from pagedserve.model.config import ModelConfig, TPShard
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.moe import SparseMoeBlock
from pagedserve.model.parallel import moe_combine, shard_checkpoint_tensor, shard_mlp_tensor
from pagedserve.model.weights import Placement, fused_rows, load_tensors

_EXPERT = re.compile(r"^layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_ROUTER = re.compile(r"^layers\.(\d+)\.block_sparse_moe\.gate\.weight$")
# per-expert projection -> (stacked parameter, which half of the rows: 0 gate, 1 up, None whole)
_EXPERT_PARTS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None),
                 "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def expert_placement(name: str, cfg: ModelConfig, shard: TPShard) -> Placement | None | bool:
    """Placement of a routed expert's tensor (None: another expert-parallel rank's expert),
    or False when `name` is not a routed expert's tensor. Without EP every expert is placed,
    cut to this rank's slice of its intermediate dimension."""
    m = _EXPERT.match(name)
    if m is None or m.group(3) not in _EXPERT_PARTS:
        return False
    layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
    first, end = shard.expert_range(cfg.moe.num_experts)
    if not first <= expert < end:
        return None
    target, half = _EXPERT_PARTS[proj]
    start, inter = shard.expert_intermediate_range(cfg.moe.intermediate_size)
    index = (expert - first,) if half is None else fused_rows(half * inter, inter, expert - first)
    transform = None if inter == cfg.moe.intermediate_size else (lambda t: shard_mlp_tensor(proj, t, start, inter))
    return Placement(f"layers.{layer}.mlp.experts.{target}", index, transform)


def shared_expert_placement(name: str, shared_width: int, shard: TPShard) -> Placement:
    """A shared expert's gate/up/down (HF name with `.shared_expert.`): fused like a dense
    MLP, cut to this rank's slice of its intermediate dimension."""
    start, size = shard.shared_intermediate_range(shared_width)
    place = llama_placement(name, None, {"gate_proj": size, "up_proj": size})
    if size == shared_width:
        return place
    proj = name.split(".")[-2]
    return Placement(place.target, place.index, lambda t: shard_mlp_tensor(proj, t, start, size))


def tp_sliced(name: str, place: Placement, cfg: ModelConfig, shard: TPShard) -> Placement:
    """`place` with the rank's slice of a Llama-named tensor (attention heads, dense MLP,
    vocabulary) taken first; the tensor itself under tp == 1."""
    if shard.tp == 1:
        return place
    return Placement(place.target, place.index, lambda t: shard_checkpoint_tensor(name, t, cfg, shard))


def llama_placement(name: str, cfg: ModelConfig | None, sizes: dict[str, int]) -> Placement:
    """q/k/v into qkv_proj, gate/up into gate_up_proj (offsets from `sizes`: the width of
    each projection of this module), everything else by its own name."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        order = ("q_proj", "k_proj", "v_proj") if _FUSED[parts[-2]] == "qkv_proj" else ("gate_proj", "up_proj")
        offset = sum(sizes[p] for p in order[:order.index(parts[-2])])
        target = ".".join(parts[:-2] + [_FUSED[parts[-2]], parts[-1]])
        return Placement(target, fused_rows(offset, sizes[parts[-2]]))
    return Placement(name)


class MoeForCausalLM(LlamaForCausalLM):
    """Llama's decoder with SparseMoeBlock MLPs where `cfg.moe.sparse_layers` says so;
    attention, dense MLPs, embedding and head sharded as Llama's, experts as model/moe.py says."""

    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__(cfg, shard)
        for layer, sparse in zip(self.layers, cfg.moe.sparse_layers):
            if sparse:
                layer.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe, self.shard, moe_combine)

    def load_checkpoint(self, tensors) -> None:
        cfg, shard = self.cfg, self.shard
        q, kv = shard.num_heads * cfg.head_dim, shard.num_kv_heads * cfg.head_dim
        shared = cfg.moe.shared_intermediate_size
        sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv,
                 "gate_proj": shard.intermediate_size, "up_proj": shard.intermediate_size}

        def resolve(name: str) -> Placement | None:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                return None
            place = expert_placement(name, cfg, shard)
            if place is not False:
                return place
            if (m := _ROUTER.match(name)) is not None:
                return Placement(f"layers.{m.group(1)}.mlp.gate.weight")
            if ".shared_expert" in name and not shared:
                return None  # HF builds a zero-width shared expert: its output (and its gate's) is 0
            if ".shared_expert." in name:
                return shared_expert_placement(name, shared, shard)
            return tp_sliced(name, llama_placement(name, cfg, sizes), cfg, shard)

        load_tensors(self, tensors, resolve)
