"""The MoE block's pieces against plain per-token references: grouped expert GEMMs equal a
loop over tokens and their chosen experts; a rank's shard (whole experts under expert
parallelism, or a slice of every expert's intermediate dimension) computes exactly its share,
so the shards' outputs sum to the whole block (the invariant the all-reduce combine relies on)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.model.config import MoEConfig, TPShard
from pagedserve.model.moe import SparseMoeBlock, grouped_experts, route

HIDDEN, INTER, EXPERTS = 16, 8, 8


def moe_config(**overrides) -> MoEConfig:
    fields = dict(num_experts=EXPERTS, top_k=2, intermediate_size=INTER, scoring="softmax", renormalize=True,
                  sparse_layers=(True,))
    return MoEConfig(**{**fields, **overrides})


def test_grouped_experts_equal_a_loop_over_tokens():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, HIDDEN, generator=gen)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen)
    ids, weights = route(torch.randn(13, EXPERTS, generator=gen), moe_config(top_k=3))
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate, up = (w13[e] @ x[t]).split(INTER)
            want[t] += weights[t, slot] * (w2[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(grouped_experts(x, ids, weights, w13, w2), want, rtol=1e-5, atol=1e-5)


def test_route_softmax_renormalised_and_deepseek_groups():
    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]])
    ids, weights = route(logits, moe_config())
    assert ids.tolist() == [[0, 1]]
    e4, e3 = torch.exp(torch.tensor(4.0)), torch.exp(torch.tensor(3.0))
    torch.testing.assert_close(weights, torch.stack([e4 / (e4 + e3), e3 / (e4 + e3)]).unsqueeze(0))
    # DeepSeek: groups of 2 ranked by the sum of their 2 best biased scores, only the best group
    # usable: the bias makes {6, 7} win, so experts 0 and 1 (the best raw scores) are not chosen,
    # and the weights are the raw sigmoid scores of 6 and 7, renormalised, times 2.5
    ds = moe_config(scoring="sigmoid", num_groups=4, topk_groups=1, routed_scaling_factor=2.5,
                    correction_bias=True, renormalize_eps=1e-20)
    bias = torch.zeros(EXPERTS)
    bias[7] = 10.0
    logits = torch.tensor([[3.0, 2.5, -5.0, -5.0, -5.0, -5.0, -5.0, -1.0]])
    ids, weights = route(logits, ds, bias)
    assert sorted(ids[0].tolist()) == [6, 7]
    scores = torch.sigmoid(logits[0, [6, 7]]) if ids[0, 0] == 6 else torch.sigmoid(logits[0, [7, 6]])
    torch.testing.assert_close(weights[0], 2.5 * scores / scores.sum())


def rank_shard(rank: int, size: int, expert_parallel: bool) -> TPShard:
    """The MoE fields of a TPShard (attention and vocabulary do not matter to the block)."""
    return TPShard(size, rank, 1, 0, 1, 0, 0, 0, 1, 0, 1, expert_parallel=expert_parallel)


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["whole-experts", "intermediate-slices"])
@pytest.mark.parametrize("size", [2, 4])
def test_expert_shards_sum_to_the_whole_block(size, expert_parallel):
    """Each rank's partial output (its whole experts, or its slice of every expert's
    intermediate dimension; its slice of the gated shared expert) sums over the ranks to
    the unsharded block's: the invariant the all-reduce combine relies on."""
    torch.manual_seed(0)
    moe = moe_config(shared_intermediate_size=12, shared_gate=True)
    full = SparseMoeBlock(HIDDEN, moe)
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(9, HIDDEN)
    with torch.no_grad():
        want = full(x)
        total = torch.zeros_like(want)
        for rank in range(size):
            shard = rank_shard(rank, size, expert_parallel)
            block = SparseMoeBlock(HIDDEN, moe, shard)
            state = dict(full.state_dict())
            first, end = shard.expert_range(EXPERTS)
            lo, width = shard.expert_intermediate_range(INTER)
            w13, w2 = state["experts.w13"][first:end], state["experts.w2"][first:end]
            state["experts.w13"] = torch.cat([w13[:, lo:lo + width], w13[:, INTER + lo:INTER + lo + width]], dim=1)
            state["experts.w2"] = w2[:, :, lo:lo + width]
            s_lo, s_width = shard.shared_intermediate_range(12)
            gate_up = state["shared_expert.gate_up_proj.weight"]
            state["shared_expert.gate_up_proj.weight"] = torch.cat([gate_up[s_lo:s_lo + s_width],
                                                                   gate_up[12 + s_lo:12 + s_lo + s_width]])
            state["shared_expert.down_proj.weight"] = state["shared_expert.down_proj.weight"][:, s_lo:s_lo + s_width]
            block.load_state_dict(state)
            total += block(x)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def test_a_shard_size_that_does_not_divide_the_experts_is_refused():
    with pytest.raises(ValueError, match="enable_expert_parallel: 3 ranks do not divide the 8 experts"):
        SparseMoeBlock(HIDDEN, moe_config(), rank_shard(0, 3, expert_parallel=True))
