"""Tensor-parallel pieces of the Llama family (Megatron-style), over torch.distributed.

    qkv_proj, gate_up_proj   column-parallel: each rank computes its heads / its slice of the
                             intermediate dimension; no communication
    o_proj, down_proj        row-parallel (RowParallelLinear, a model.layers.Linear, so the
                             GEMM path chosen per shape applies): each rank multiplies its slice
                             of the input, then one all-reduce sums the partial outputs; a bias
                             is added once, after the sum
    embed_tokens             vocab-parallel: a rank looks up the ids in its rows, zeros for the
                             rest, and an all-reduce assembles each row (one non-zero term: exact)
    lm_head                  vocab-parallel: each rank computes its vocabulary slice's logits,
                             gathered on rank 0, where sampling happens

With tp == 1 every layer is exactly the unsharded one (no collective, the same ops), so a
single-rank engine computes what it always did. The slices each rank takes of the
checkpoint's full tensors are `shard_checkpoint_tensor`'s; which heads and rows a rank owns
is `model.config.TPShard`'s.

The process group is torch.distributed's default group (gloo on CPU, NCCL on CUDA), set up
by worker/worker.py before the model is built. Time spent in collectives is accumulated in
COMM_TIME so benchmarks can report the all-reduce share of a step.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedserve.model.config import ModelConfig, TPShard
from pagedserve.model.layers import Linear

COMM_TIME = {"all_reduce": 0.0, "gather": 0.0, "calls": 0}


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    t0 = time.perf_counter()
    dist.all_reduce(x)
    COMM_TIME["all_reduce"] += time.perf_counter() - t0
    COMM_TIME["calls"] += 1
    return x


def gather_on_rank0(x: torch.Tensor, shard: TPShard) -> torch.Tensor | None:
    """Concatenate every rank's last dimension on rank 0 (None elsewhere)."""
    t0 = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(shard.tp)] if shard.rank == 0 else None
    dist.gather(x.contiguous(), parts, dst=0)
    COMM_TIME["gather"] += time.perf_counter() - t0
    COMM_TIME["calls"] += 1
    return torch.cat(parts, dim=-1) if parts is not None else None


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r @ W_r^T, then + bias (once). A model.layers.Linear: its GEMM
    runs by the LinearMethod chosen for its (per-rank) shape at load, and its parameter names
    stay `weight`/`bias` so checkpoints load by their HF names."""

    def __init__(self, in_features_per_rank: int, out_features: int, bias: bool, tp: int) -> None:
        super().__init__(in_features_per_rank, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return super().forward(x)
        y = all_reduce(self.method.apply(x, self.weight, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + vocab_per_rank) of the table; the last rank's tail
    past the real vocabulary is zero padding."""

    def __init__(self, shard: TPShard, hidden_size: int) -> None:
        super().__init__(shard.vocab_per_rank, hidden_size)
        self.shard = shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.tp == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.shard.vocab_start) & (ids < self.shard.vocab_end)
        local = torch.where(mine, ids - self.shard.vocab_start, torch.zeros_like(ids))
        rows = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(rows)


def gather_vocab_logits(local: torch.Tensor, shard: TPShard, vocab_size: int) -> torch.Tensor | None:
    """This rank's vocabulary slice of the logits -> the full vocabulary's on rank 0 (None on
    the others)."""
    if shard.tp == 1:
        return local
    full = gather_on_rank0(local, shard)
    return None if full is None else full[..., :vocab_size]


def shard_checkpoint_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig, shard: TPShard) -> torch.Tensor:
    """The slice of one full HF checkpoint tensor (name without the `model.` prefix) that
    this rank holds. Replicated tensors (norms, row-parallel biases) come back whole."""
    if shard.tp == 1:
        return tensor
    parts = name.split(".")
    proj, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    hd = cfg.head_dim
    if proj == "q_proj":
        return tensor[shard.q_head_start * hd:(shard.q_head_start + shard.num_heads) * hd]
    if proj in ("k_proj", "v_proj"):
        return tensor[shard.kv_head_start * hd:(shard.kv_head_start + shard.num_kv_heads) * hd]
    if proj == "o_proj" and kind == "weight":
        return tensor[:, shard.q_head_start * hd:(shard.q_head_start + shard.num_heads) * hd]
    if proj in ("gate_proj", "up_proj"):
        return tensor[shard.intermediate_start:shard.intermediate_start + shard.intermediate_size]
    if proj == "down_proj" and kind == "weight":
        return tensor[:, shard.intermediate_start:shard.intermediate_start + shard.intermediate_size]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        rows = tensor[shard.vocab_start:shard.vocab_end]
        pad = shard.vocab_per_rank - rows.shape[0]
        return F.pad(rows, (0, 0, 0, pad)) if pad else rows
    return tensor


def shard_mlp_tensor(proj: str, tensor: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """An MLP projection's slice of the intermediate dimension [start, start + size): rows
    of gate/up (w1/w3), columns of down (w2). Used for experts and shared experts, whose
    widths are not the dense MLP's."""
    if proj in ("gate_proj", "up_proj", "w1", "w3"):
        return tensor[start:start + size]
    if proj in ("down_proj", "w2"):
        return tensor[:, start:start + size]
    raise ValueError(f"shard_mlp_tensor: {proj!r} is not an MLP projection")


def shard_heads(tensor: torch.Tensor, shard: TPShard, width: int, dim: int = 0) -> torch.Tensor:
    """The rows (dim 0) or columns (dim 1) of this rank's query heads, `width` per head
    (MLA's q_b_proj and kv_b_proj rows, o_proj columns)."""
    lo, hi = shard.q_head_start * width, (shard.q_head_start + shard.num_heads) * width
    return tensor[lo:hi] if dim == 0 else tensor[:, lo:hi]
