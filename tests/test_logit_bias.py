"""logit_bias against hand computation: the sampler adds each bias to its token's logit
before anything else reads them (logprobs are log_softmax of logits + bias, greedy picks
argmax of logits + bias); end to end, a +100 bias makes greedy text that token and a -100
bias on HF's greedy token moves greedy to HF's runner-up; bad values are 400s naming
logit_bias."""
from __future__ import annotations

import httpx
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.default_model_path import DEFAULT_MODEL_DIR
from pagedserve.worker.model_runner import CachedRequestState
from pagedserve.worker.sampler import Sampler


def _row(rid, params):
    return CachedRequestState(rid, [1, 2, 3], params, [1, 2, 3], [0])


def test_sampler_adds_bias_before_logprobs_and_greedy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=gen)
    biases = [{5: 7.5, 11: -3.0, 39: 100.0}, {}, {0: -100.0, 1: 2.25}]
    reqs = [_row(str(i), SamplingParams(temperature=0, logprobs=5, logit_bias=b or None)) for i, b in enumerate(biases)]
    tokens, lps = Sampler(frozenset(), 0, torch.device("cpu"))(logits, reqs)
    for row, bias in enumerate(biases):
        expected = logits[row].clone()
        for token, value in bias.items():  # by hand, one entry at a time
            expected[token] = expected[token] + value
        ref = torch.log_softmax(expected, dim=-1)
        assert tokens[row] == int(expected.argmax())
        assert lps[row].logprob == pytest.approx(ref[tokens[row]].item(), abs=1e-6)
        ref_top = ref.topk(5)
        assert [t for t, _ in lps[row].top] == ref_top.indices.tolist()
        assert [v for _, v in lps[row].top] == pytest.approx(ref_top.values.tolist(), abs=1e-6)


def test_bias_shifts_the_sampled_distribution():
    """Temperature 1: token frequencies follow softmax(logits + bias) (chi-square-free check:
    a token biased from 1/4 to ~0.9 of the mass is drawn about that often)."""
    logits = torch.zeros(1, 4)
    params = SamplingParams(temperature=1.0, seed=3, logit_bias={2: float(torch.log(torch.tensor(27.0)))})
    sampler = Sampler(frozenset(), 0, torch.device("cpu"))
    draws = [sampler(logits, [_row("a", params)])[0][0] for _ in range(3000)]
    share = draws.count(2) / len(draws)
    assert share == pytest.approx(27 / 30, abs=0.03)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=128, num_kv_blocks=64)


def test_end_to_end_against_hf_logits(llm):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)("import os\nimport").input_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1]
    best, runner_up = logits.topk(2).indices.tolist()
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert plain.outputs[0].token_ids == [best]
    banned = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logit_bias={best: -100}),
                          use_tqdm=False)[0]
    assert banned.outputs[0].token_ids == [runner_up]
    forced = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={77: 100},
                                                logprobs=0), use_tqdm=False)[0]
    assert forced.outputs[0].token_ids == [77] * 5
    biased = logits.clone()
    biased[77] += 100
    assert forced.outputs[0].logprobs[0].logprob == pytest.approx(torch.log_softmax(biased, -1)[77].item(), abs=1e-4)


def test_engine_refuses_ids_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match="^logit_bias: token id 4096"):
        llm.generate("x", SamplingParams(logit_bias={4096: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="^logit_bias:"):
        SamplingParams(logit_bias={3: 100.5})


@pytest.fixture(scope="module")
def client():
    from pagedserve.config import EngineConfig
    from pagedserve.server.launcher import ServerThread, build_server
    app, _ = build_server(EngineConfig(num_kv_blocks=64, max_model_len=256))
    with ServerThread(app) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            yield c


def test_http_bias_forces_a_token(client):
    for path, extra in (("/v1/completions", {"prompt": "def f():"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = client.post(path, json={**extra, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                    "logit_bias": {"77": 100}})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0].get("text") or r.json()["choices"][0]["message"]["content"]
        detok = client.post("/detokenize", json={"tokens": [77] * 4}).json()["prompt"]
        assert text == detok


@pytest.mark.parametrize("bias", [
    {"4096": 1}, {"-1": 1}, {"abc": 1}, {"5": 100.5}, {"5": -101}, {str(i): 1 for i in range(301)}, {"5": "x"},
])
def test_http_bad_bias_is_a_400_naming_logit_bias(client, bias):
    r = client.post("/v1/completions", json={"prompt": "x", "logit_bias": bias})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("logit_bias"), r.json()
