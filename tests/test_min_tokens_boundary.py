"""min_tokens at the exact boundary, with a stop the model would take at once.

vLLM's rule (SamplingParams.min_tokens: "minimum number of tokens to generate per output sequence
before EOS or stop_token_ids can be generated"): while fewer than min_tokens tokens have been
generated, the sampler masks EOS and the stop token ids (vLLM's MinTokensLogitsProcessor), so with
min_tokens=k the k first tokens are never a stop token and the stop can come at token k+1, which
is output (its id is in token_ids). Stop strings are looked for only once more than k tokens were
generated (vllm/v1/engine/detokenizer.py: `if self.stop and len(self.output_token_ids) >
self.min_tokens`; vLLM's tests/detokenizer/test_min_tokens.py).

The stop is made certain by a +100 logit_bias on the stop token: without min_tokens the very
first token stops. Each case then has one right answer, k+1 tokens, and an off-by-one either way
(one token masked too many or too few, a stop accepted at k) changes the count. The k tokens
before the stop are checked against HF's logits on the same weights (teacher forcing: each is the
argmax once the bias is added and the masked ids removed).
"""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams

PROMPT = [5, 6, 7, 8]
BIAS = 100.0


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), num_kv_blocks=64, max_model_len=128)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokens(llm):
    tok = llm.get_tokenizer()
    x = tok.convert_tokens_to_ids("x")
    assert tok.decode([x]) == "x" and x != tok.eos_token_id
    return {"eos": tok.eos_token_id, "x": x}


def assert_hf_picks(hf_model, output: list[int], bias: dict[int, float], banned_until: int, banned: set[int]):
    """Each output token is the argmax of HF's logits plus `bias`, with `banned` removed from
    the first `banned_until` positions (what the sampler does for min_tokens)."""
    ids = torch.tensor([PROMPT + output[:-1]])
    with torch.no_grad():
        logits = hf_model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(PROMPT) - 1:].float()
    for token, value in bias.items():
        logits[:, token] += value
    logits[:banned_until, sorted(banned)] = float("-inf")
    assert logits.argmax(dim=-1).tolist() == output


@pytest.mark.parametrize("k", [0, 1, 4])
def test_eos_comes_exactly_after_min_tokens(llm, hf_model, tokens, k):
    eos = tokens["eos"]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, min_tokens=k, logit_bias={eos: BIAS}),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == k + 1 and out.token_ids[k] == eos
    assert eos not in out.token_ids[:k]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert_hf_picks(hf_model, out.token_ids, {eos: BIAS}, k, {eos})


@pytest.mark.parametrize("k", [0, 1, 4])
def test_stop_token_comes_exactly_after_min_tokens(llm, hf_model, tokens, k):
    x, eos = tokens["x"], tokens["eos"]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, min_tokens=k, stop_token_ids=[x],
                                                logit_bias={x: BIAS}), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == k + 1 and out.token_ids[k] == x
    assert x not in out.token_ids[:k]
    assert out.finish_reason == "stop" and out.stop_reason == x
    assert_hf_picks(hf_model, out.token_ids, {x: BIAS}, k, {x, eos})


@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_is_looked_for_only_past_min_tokens(llm, tokens, k, include):
    """Every token is "x" (biased), and "x" is the stop string: tokens 1..k are not looked at, the
    (k+1)-th ends the request. The text holds the k tokens before it (and the stop string itself
    with include_stop_str_in_output)."""
    x = tokens["x"]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, min_tokens=k, stop=["x"],
                                                include_stop_str_in_output=include, logit_bias={x: BIAS},
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [x] * (k + 1)
    assert out.finish_reason == "stop" and out.stop_reason == "x"
    assert out.text == "x" * (k + 1 if include else k)
