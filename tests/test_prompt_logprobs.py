"""Prompt logprobs against HF transformers (fp32, same weights): each prompt token's logprob
equals log_softmax of HF's logits at the position before it, within 1e-4, with chunked
prefill, under preemption, and with prefix caching on (the request refuses the cache).
Then lm-eval's `local-completions` log-likelihood request, sent exactly as lm-eval 0.4
builds it (echo=true, logprobs=1, max_tokens=1, temperature=0, token-id prompts) and read
exactly as it parses it (token_logprobs[ctxlen:-1]), picks the same answers as HF on a small
hand-made multiple-choice task."""
from __future__ import annotations

from operator import itemgetter

import httpx
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.default_model_path import DEFAULT_MODEL_DIR

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox",
    "import os\nimport sys",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "x = 1",
    "for i in range(10):\n    print(i)\n",
    "# A comment that runs on for a while, so the prompt spans several prefill chunks and blocks.\n",
    "with open('data.txt') as f:\n    lines = f.readlines()\n",
    "try:\n    import json\nexcept ImportError:\n    json = None\n",
    "return",
]
TOP_K = 3


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_hf(hf_model, token_ids, prompt_logprobs) -> None:
    assert len(prompt_logprobs) == len(token_ids) and prompt_logprobs[0] is None
    ref = hf_logprobs(hf_model, token_ids)
    for j in range(1, len(token_ids)):
        lp = prompt_logprobs[j]
        assert lp.token_id == token_ids[j]
        assert abs(lp.logprob - ref[j - 1, token_ids[j]].item()) < 1e-4, (j, lp.logprob)
        assert lp.rank == int((ref[j - 1] > ref[j - 1, token_ids[j]]).sum()) + 1 or \
            abs(ref[j - 1].sort(descending=True).values[lp.rank - 1] - lp.logprob) < 1e-4
        top_ref = ref[j - 1].topk(TOP_K).values
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top_ref, atol=1e-4)
        for token, value in lp.top:
            assert abs(ref[j - 1, token].item() - value) < 1e-4


CONFIGS = {
    # chunks of 16 tokens: every prompt but the shortest is scored over several steps
    "chunked": dict(max_num_batched_tokens=16, num_kv_blocks=200),
    # 8 blocks of 16 tokens for 10 requests of up to ~30 prompt + 24 output tokens: preempted by recompute
    "preempted": dict(max_num_batched_tokens=32, num_kv_blocks=8, max_num_seqs=10, preemption_mode="recompute"),
    "swapped": dict(max_num_batched_tokens=32, num_kv_blocks=8, max_num_seqs=10, preemption_mode="swap",
                    swap_space=1 << 24),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prompt_logprobs_equal_hf(hf_model, tokenizer, name):
    llm = LLM(dtype="float32", max_model_len=128, enable_prefix_caching=False, **CONFIGS[name])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=TOP_K)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    if name != "chunked":
        assert llm.engine.scheduler.total_preemptions > 0
    for prompt, out in zip(PROMPTS, outs):
        check_against_hf(hf_model, tokenizer(prompt).input_ids, out.prompt_logprobs)


def test_prompt_logprobs_when_preempted_mid_prompt(hf_model, tokenizer):
    """Recompute preemption in the middle of a prompt: the recomputed chunks must not score
    (and report) the tokens already scored a second time."""
    llm = LLM(dtype="float32", max_model_len=96, enable_prefix_caching=False, max_num_batched_tokens=8,
              num_kv_blocks=6, max_num_seqs=10, preemption_mode="recompute")
    scheduler = llm.engine.scheduler
    mid_prompt = []
    preempt = scheduler._preempt

    def recording(victim, *args):
        if 0 < victim.num_computed_tokens < victim.num_prompt_tokens:
            mid_prompt.append(victim.request_id)
        return preempt(victim, *args)

    scheduler._preempt = recording
    long_prompts = [p for p in PROMPTS if len(tokenizer(p).input_ids) > 16]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=TOP_K)
    outs = llm.generate(long_prompts, params, use_tqdm=False)
    assert mid_prompt, "the pool was meant to preempt a request in the middle of its prompt"
    for prompt, out in zip(long_prompts, outs):
        check_against_hf(hf_model, tokenizer(prompt).input_ids, out.prompt_logprobs)


def test_prefix_cache_is_refused_for_prompt_logprobs(hf_model, tokenizer):
    llm = LLM(dtype="float32", max_model_len=128, num_kv_blocks=200, enable_prefix_caching=True)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # fills the cache
    hits_before = llm.engine.kv_cache_manager.prefix_hits
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP_K), use_tqdm=False)
    assert llm.engine.kv_cache_manager.prefix_hits == hits_before
    assert all(m.num_cached_tokens == 0 for out in outs for m in out.metrics)
    for prompt, out in zip(PROMPTS, outs):
        check_against_hf(hf_model, tokenizer(prompt).input_ids, out.prompt_logprobs)
    # Without prompt logprobs the same prompts do hit the cache: the refusal is per request.
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert llm.engine.kv_cache_manager.prefix_hits > hits_before


def test_n_samples_share_one_prompt_scoring(hf_model, tokenizer):
    llm = LLM(dtype="float32", max_model_len=128, num_kv_blocks=64)
    out = llm.generate(PROMPTS[1], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4,
                                                  prompt_logprobs=TOP_K), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    check_against_hf(hf_model, tokenizer(PROMPTS[1]).input_ids, out.prompt_logprobs)


# -- the HTTP API: echo + logprobs, and lm-eval's log-likelihood request ---------------------
@pytest.fixture(scope="module")
def client():
    from pagedserve.config import EngineConfig
    from pagedserve.server.launcher import ServerThread, build_server
    app, _ = build_server(EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=256,
                                       max_num_batched_tokens=16))
    with ServerThread(app) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield c


def test_echo_logprobs_first_token_null_then_hf(client, hf_model, tokenizer):
    prompt = PROMPTS[0]
    ids = tokenizer(prompt).input_ids
    for max_tokens in (0, 3):
        body = client.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 2,
                                                    "max_tokens": max_tokens, "temperature": 0}).json()
        choice = body["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"].startswith(prompt)
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = hf_logprobs(hf_model, ids)
        for j in range(1, len(ids)):
            assert abs(lp["token_logprobs"][j] - ref[j - 1, ids[j]].item()) < 1e-4
        assert body["usage"]["completion_tokens"] == max_tokens
        if max_tokens == 0:
            assert choice["text"] == prompt


def test_echo_logprobs_streamed(client, hf_model, tokenizer):
    import json
    prompt = PROMPTS[2]
    ids = tokenizer(prompt).input_ids
    token_lps, text = {0: [], 1: []}, {0: "", 1: ""}
    with client.stream("POST", "/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 1, "n": 2,
                                                        "max_tokens": 2, "temperature": 1.0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text[choice["index"]] += choice["text"]
                    token_lps[choice["index"]] += choice["logprobs"]["token_logprobs"]
    ref = hf_logprobs(hf_model, ids)
    for i in (0, 1):  # each sample echoes the prompt with its logprobs
        lps = token_lps[i]
        assert text[i].startswith(prompt) and len(lps) == len(ids) + 2 and lps[0] is None
        assert all(abs(lps[j] - ref[j - 1, ids[j]].item()) < 1e-4 for j in range(1, len(ids)))


# A hand-made multiple-choice task: (context, [continuations]).
TASK = [
    ("import os\nimport", [" sys", " banana", " 42"]),
    ("def add(a, b):\n    return a", [" + b", " - zebra", "!!!"]),
    ("for i in range(10):\n    print(", ["i)", "])", "class"]),
]


def lm_eval_payload(model: str, requests: list[list[int]]) -> dict:
    """What lm-eval 0.4's LocalCompletionsAPI._create_payload sends for log-likelihoods."""
    return {"model": model, "prompt": requests, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}


def lm_eval_parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """What lm-eval 0.4's LocalCompletionsAPI.parse_logprobs does with the answer."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs))
        res.append((sum(tokens_logprobs), is_greedy))
    return res


def test_lm_eval_local_completions_loglikelihood(client, hf_model, tokenizer):
    model = client.get("/v1/models").json()["data"][0]["id"]
    for context, continuations in TASK:
        ctx = tokenizer(context).input_ids
        requests = [ctx + tokenizer(c, add_special_tokens=False).input_ids for c in continuations]
        r = client.post("/v1/completions", json=lm_eval_payload(model, requests))
        assert r.status_code == 200, r.text
        scores = lm_eval_parse_logprobs(r.json(), [len(ctx)] * len(requests))
        ref_scores = []
        for ids in requests:
            ref = hf_logprobs(hf_model, ids)
            ref_scores.append(sum(ref[j - 1, ids[j]].item() for j in range(len(ctx), len(ids))))
            greedy = all(ref[j - 1].argmax().item() == ids[j] for j in range(len(ctx), len(ids)))
            assert scores[len(ref_scores) - 1][1] == greedy
        assert [s for s, _ in scores] == pytest.approx(ref_scores, abs=1e-3)
        assert max(range(3), key=lambda i: scores[i][0]) == max(range(3), key=lambda i: ref_scores[i])


def test_prompt_logprobs_field_and_bad_values(client):
    r = client.post("/v1/completions", json={"prompt": "x = 1", "prompt_logprobs": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = client.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = client.post("/v1/completions", json={"prompt": "x = 1", "echo": True, "logprobs": 2, "prompt_logprobs": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
