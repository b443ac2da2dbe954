"""Logprobs against HF transformers: every sampled token's logprob, its rank and the top-5
equal HF's log_softmax over the same weights' logits (fp32, atol 1e-4), also when prompts
are prefilled in chunks and requests are preempted and recomputed in between. (Swap moves
the KV unchanged; that swapped requests continue token-identically is test_parity's.)"""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams

ATOL = 1e-4
TOP = 5
PROMPT_LENS = (70, 95, 120, 60)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: HF's log_softmax of the logits each output token was drawn from."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)


def hf_rank(row: torch.Tensor, token: int) -> tuple[int, int]:
    """vLLM's rank of `token` in one row of HF's logprobs: how many tokens have a logprob >= its
    own, itself included (vllm/v1/sample/ops/logprobs.py, batched_count_greater_than:
    `(x >= values).sum(-1)`), i.e. 1 + the tokens strictly more likely. As (low, high): one exact
    integer (low == high) unless another token lies within ATOL of it, where fp32 rounding may
    order the two either way. The token itself is never counted among those more likely."""
    others = torch.cat([row[:token], row[token + 1:]])
    value = row[token].item()
    return int((others > value + ATOL).sum()) + 1, int((others > value - ATOL).sum()) + 1


def prompts() -> list[list[int]]:
    return [[(i * 37 + 11 * n) % 380 + 2 for i in range(n)] for n in PROMPT_LENS]


def test_logprobs_equal_hf_through_chunked_prefill_and_preemption(tiny_llama, hf_model):
    # 12 blocks of 16 for four requests of up to 136 tokens: they preempt each other; a budget of
    # 32 tokens a step prefills every prompt in chunks.
    llm = LLM(str(tiny_llama), num_kv_blocks=12, max_model_len=192, max_num_batched_tokens=32,
              preemption_mode="recompute", enable_prefix_caching=False)
    params = [SamplingParams(max_tokens=16, temperature=0, logprobs=TOP, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=1.0, seed=3, logprobs=TOP, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.7, top_k=50, seed=4, logprobs=TOP, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=1.2, seed=5, logprobs=TOP, ignore_eos=True)]
    outs = llm.generate(prompts(), params, use_tqdm=False)
    assert all(n > 32 for n in PROMPT_LENS)  # so every prompt is prefilled in chunks
    assert sum(m.num_preemptions for o in outs for m in o.metrics) > 0
    ranks, num_exact_ranks = [], 0
    for prompt, out in zip(prompts(), outs):
        comp = out.outputs[0]
        ref = hf_logprobs(hf_model, prompt, comp.token_ids)
        assert len(comp.logprobs) == len(comp.token_ids) == 16
        for j, (token, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
            row = ref[j]
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(row[token].item(), abs=ATOL), (out.request_id, j)
            low, high = hf_rank(row, token)
            assert low <= lp.rank <= high, (out.request_id, j, lp.rank, low, high)
            ranks.append(lp.rank)
            num_exact_ranks += low == high
            top_values, top_ids = row.topk(TOP)
            assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=ATOL)
            for tid, v in lp.top:  # each listed id carries HF's value for that id
                assert v == pytest.approx(row[tid].item(), abs=ATOL)
        assert comp.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in comp.logprobs), abs=1e-3)
    assert max(ranks) > 1  # the sampled rows did draw tokens other than the most likely
    assert num_exact_ranks >= 0.9 * len(ranks)  # near-ties are the exception: the ranks are compared exactly
