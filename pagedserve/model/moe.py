"""Mixture-of-experts MLP: router, grouped expert GEMMs, shared expert; expert parallelism.

Invariants:
- Routing is each architecture's own rule (MoEConfig): Mixtral and Qwen2-MoE take the
  top-k of a softmax over all experts (renormalised to sum 1 for Mixtral, and for Qwen2-MoE
  when norm_topk_prob); DeepSeek-V3 takes sigmoid scores, chooses by score + correction
  bias among the best `topk_groups` groups (a group ranked by the sum of its two best
  biased scores), weights by the unbiased scores, renormalised, times routed_scaling_factor.
  The router runs in fp32, as HF's routers do.
- Experts run without a loop over tokens: the step's (token, slot) pairs are sorted by
  expert id, each active expert multiplies its contiguous run of rows in one GEMM pair,
  and the weighted rows are scatter-added back to their tokens.
- Tensor parallelism (a block built with a TPShard of tp > 1): the router is replicated,
  so every rank routes every token the same way (DeepSeek's groups, correction bias,
  renormalisation and scaling all run unchanged on each rank). Without expert parallelism
  (vLLM's default) each rank holds every expert's [start, start + I / tp) slice of the
  intermediate dimension (w1/w3 rows, w2 columns); with it (`shard.expert_parallel`) each
  holds whole experts [rank * E / tp, (rank + 1) * E / tp) and computes only those. The
  shared expert is sharded like a dense MLP either way, and its Qwen2-MoE gate (a scalar
  per token) scales each rank's partial output. Either way a rank's output is a partial
  sum over its slices or its experts, and one all-reduce (`combine`) of routed + shared
  partials gives the full MLP output: the tokens are already on every rank (attention is
  TP, so its output is replicated), which makes dispatch an identity and the all-reduce
  the combine (an all-gather + reduce-scatter over replicated activations computes the
  same sum, in two collectives instead of one).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model.config import MoEConfig, TPShard
from pagedserve.model.cpu import fused
from pagedserve.model.layers import Linear
from pagedserve.model import parallel
from pagedserve.model.parallel import RowParallelLinear


def route(logits: torch.Tensor, moe: MoEConfig, correction_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (fp32) -> (expert ids [T, k], weights [T, k] fp32)."""
    if moe.scoring == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, moe.top_k, dim=-1)
    else:
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias
        if moe.num_groups > 1:
            choice = _limit_to_best_groups(choice, moe.num_groups, moe.topk_groups)
        ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + moe.renormalize_eps)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return ids, weights


def _limit_to_best_groups(choice: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Scores of experts outside each token's `topk_groups` best groups set to -inf; a
    group's rank is the sum of its two best scores (DeepSeek-V3's noaux_tc)."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """sum over each token's chosen experts of weight x down(silu(gate(x)) * up(x)).

    x [T, H]; ids, weights [T, k]; w13 [E_local, 2I, H] (gate rows then up rows); w2
    [E_local, H, I]. Experts outside [first_expert, first_expert + E_local) contribute
    nothing here (another expert-parallel rank holds them). One GEMM pair per active expert
    over its rows, sorted by expert id."""
    out = torch.zeros_like(x)
    num_local, inter = w13.shape[0], w2.shape[2]
    flat_ids = ids.reshape(-1) - first_expert
    local = (flat_ids >= 0) & (flat_ids < num_local)
    flat_ids = torch.where(local, flat_ids, num_local)       # other ranks' experts sort to the end
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_local + 1)[:num_local].tolist()
    token_of = order // ids.shape[1]                           # row of x each sorted pair reads
    pair_weights = weights.reshape(-1)[order].to(x.dtype)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        xe = x.index_select(0, token_of[rows])
        gate, up = F.linear(xe, w13[expert]).split(inter, dim=-1)
        ye = F.linear(F.silu(gate) * up, w2[expert]) * pair_weights[rows, None]
        out.index_add_(0, token_of[rows], ye)
        start += count
    return out


class DenseMLP(nn.Module):
    """SwiGLU MLP with gate/up fused (the dense layers and the shared experts).
    `intermediate_size` is this rank's share; `tp` > 1 with `reduce`: down_proj is
    row-parallel and sums the ranks' partial outputs itself (a dense layer); without
    `reduce` the partial output is returned (a shared expert, summed with the experts')."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: int = 1, reduce: bool = True) -> None:
        super().__init__()
        self.inter = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = (RowParallelLinear(intermediate_size, hidden_size, False, tp) if reduce
                          else Linear(intermediate_size, hidden_size, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router + routed experts (this rank's share) + optional shared expert (and its gate).

    Parameter names: gate.weight [E, H] (the router), gate.e_score_correction_bias [E]
    (DeepSeek), experts.w13 [E_local, 2 I_local, H], experts.w2 [E_local, H, I_local],
    shared_expert.*, shared_expert_gate.weight [1, H] (Qwen2-MoE)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, shard: TPShard | None = None, combine=None) -> None:
        super().__init__()
        self.moe = moe
        self.tp = shard.tp if shard is not None else 1
        if shard is None:
            self.first_expert, end, inter = 0, moe.num_experts, moe.intermediate_size
            shared_inter = moe.shared_intermediate_size
        else:
            if shard.expert_parallel and moe.num_experts % shard.tp:   # check_model_parallel refuses it first
                raise ValueError(f"enable_expert_parallel: {shard.tp} ranks do not divide the {moe.num_experts} experts")
            self.first_expert, end = shard.expert_range(moe.num_experts)
            inter = shard.expert_intermediate_range(moe.intermediate_size)[1]
            shared_inter = shard.shared_intermediate_range(moe.shared_intermediate_size)[1]
        num_local = end - self.first_expert
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        if moe.correction_bias:
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts))
        self.experts = nn.Module()
        self.experts.w13 = nn.Parameter(torch.empty(num_local, 2 * inter, hidden_size))
        self.experts.w2 = nn.Parameter(torch.empty(num_local, hidden_size, inter))
        self.shared_expert = (DenseMLP(hidden_size, shared_inter, self.tp, reduce=False)
                              if moe.shared_intermediate_size else None)
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if moe.shared_gate else None
        # sums the ranks' partial outputs (an all-reduce); None: one rank holds the whole MLP
        self.combine = combine
        # DP attention + EP: this rank's tokens are its own; the experts' are exchanged
        self.dp_experts = shard is not None and shard.dp_size > 1 and shard.expert_parallel

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe.router_fp32:  # HF keeps DeepSeek's router weight in fp32
            return F.linear(x.float(), self.gate.weight.float())
        return F.linear(x, self.gate.weight).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(self.gate, "e_score_correction_bias", None)
        ids, weights = route(self.router_logits(x), self.moe, None if bias is None else bias.float())
        if self.dp_experts:
            return self._forward_dp(x, ids, weights)
        out = grouped_experts(x, ids, weights, self.experts.w13, self.experts.w2, self.first_expert)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)   # this rank's partial sum of the shared expert
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if self.combine is not None and self.tp > 1:
            out = self.combine(out)
        return out

    def _forward_dp(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """DP attention + EP: each data-parallel rank routes its own tokens; the tokens and
        their routing go to every rank (all-gather), each computes its whole experts' share
        for all of them, and the shares are summed back (all-reduce), each rank keeping its
        own rows. The shared expert is whole on every rank and runs on its own tokens. A rank
        with no tokens this step calls this with x of 0 rows: it still computes its experts
        for the others' (the lockstep: worker/dp_lockstep.py)."""
        routing = torch.cat([ids.to(torch.float32), weights.to(torch.float32)], dim=1)  # ids < 2^24: exact
        x_all, routing_all, counts = parallel.ep_dispatch(x, routing)
        k = ids.shape[1]
        out_all = grouped_experts(x_all, routing_all[:, :k].to(torch.int64), routing_all[:, k:], self.experts.w13,
                                  self.experts.w2, self.first_expert)
        out = parallel.ep_combine(out_all, counts)
        if self.shared_expert is not None and x.shape[0]:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def dummy(self, dtype: torch.dtype, device: torch.device) -> None:
        """This layer's part of a step in which this rank has no tokens (DP + EP lockstep)."""
        x = torch.empty(0, self.gate.weight.shape[1], dtype=dtype, device=device)
        k = self.moe.top_k
        self._forward_dp(x, torch.empty(0, k, dtype=torch.int64, device=device),
                         torch.empty(0, k, dtype=torch.float32, device=device))
