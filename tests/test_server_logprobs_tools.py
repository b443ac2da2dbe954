"""The HTTP API's prompt_logprobs, echo text_offset and truncated "required" tool calls.

- `prompt_logprobs` is returned where vLLM returns it (per choice on /v1/completions, at the
  top level on /v1/chat/completions; null first, then per position {token id: {logprob, rank,
  decoded_token}}), and every value equals HF's log_softmax over the same weights (fp32);
  with stream=true it is a 400 naming the field (vLLM refuses it there too), never dropped.
- `text_offset` is one running offset over a choice's tokens, echoed prompt included: each
  token's offset is the length of the tokens before it joined, for n > 1, several prompts,
  and streamed (the chunks' offsets go on from the previous chunk's).
- tool_choice "required" cut off by max_tokens: the whole answer and the stream agree
  (finish_reason "length", the calls begun so far in tool_calls with their partial
  arguments) and neither shows the constraint's internal {"name", "parameters"} array.
"""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from pagedserve.default_model_path import DEFAULT_MODEL_DIR

ATOL = 1e-4
PROMPTS = ["import os\nimport sys\n\ndef main(", "for i in range(10):\n    print(i)\n"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def client():
    from pagedserve.config import EngineConfig
    from pagedserve.server.launcher import ServerThread, build_server
    app, _ = build_server(EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=512,
                                       max_num_batched_tokens=16))
    with ServerThread(app) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield c


def _post(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _events(client, path, body) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


# -- prompt_logprobs ------------------------------------------------------------------------
def check_prompt_logprobs(hf_model, tokenizer, token_ids: list[int], scored: list, k: int) -> None:
    """vLLM's shape, and each value HF's: the prompt token's logprob and rank, and the top k."""
    assert len(scored) == len(token_ids) and scored[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].float(), dim=-1)
    for j in range(1, len(token_ids)):
        row, entry, token = ref[j - 1], scored[j], token_ids[j]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(row[token].item(), abs=ATOL), j
        # rank: 1 + the tokens HF finds more likely (a tie within ATOL may go either way)
        lo, hi = int((row > own["logprob"] + ATOL).sum()) + 1, int((row > own["logprob"] - ATOL).sum()) + 1
        assert lo <= own["rank"] <= hi, j
        assert own["decoded_token"] == tokenizer.decode([token])
        top_values, top_ids = row.topk(k)
        assert set(entry) == {str(token)} | {str(t) for t in top_ids.tolist()}
        for rank, (value, tid) in enumerate(zip(top_values.tolist(), top_ids.tolist()), 1):
            assert entry[str(tid)]["logprob"] == pytest.approx(value, abs=ATOL)
            assert entry[str(tid)]["rank"] == rank
            assert entry[str(tid)]["decoded_token"] == tokenizer.decode([tid])


def test_completions_return_prompt_logprobs_per_choice(client, hf_model, tokenizer):
    k = 3
    body = _post(client, "/v1/completions", {"prompt": PROMPTS, "n": 2, "max_tokens": 2, "temperature": 1.0,
                                             "seed": 5, "prompt_logprobs": k})
    assert len(body["choices"]) == 4
    for choice in body["choices"]:
        prompt = PROMPTS[choice["index"] // 2]
        assert choice["logprobs"] is None  # logprobs was not asked for
        check_prompt_logprobs(hf_model, tokenizer, tokenizer(prompt).input_ids, choice["prompt_logprobs"], k)


def test_prompt_logprobs_zero_is_the_prompt_tokens_alone(client, hf_model, tokenizer):
    body = _post(client, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 1, "prompt_logprobs": 0})
    scored = body["choices"][0]["prompt_logprobs"]
    check_prompt_logprobs(hf_model, tokenizer, tokenizer(PROMPTS[1]).input_ids, scored, 0)


def test_chat_returns_prompt_logprobs_at_the_top_level(client, hf_model, tokenizer):
    k = 2
    body = _post(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": k})
    templated = _post(client, "/tokenize", {"messages": MESSAGES})["tokens"]
    check_prompt_logprobs(hf_model, tokenizer, templated, body["prompt_logprobs"], k)
    assert all("prompt_logprobs" not in c for c in body["choices"])


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x = 1", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
])
@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs_with_stream_is_a_400_naming_it(client, path, body, k):
    r = client.post(path, json={**body, "prompt_logprobs": k, "stream": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_logprobs"


# -- text_offset ----------------------------------------------------------------------------
def running_offsets(tokens: list[str]) -> list[int]:
    return [len("".join(tokens[:i])) for i in range(len(tokens))]


@pytest.mark.parametrize("echo", [True, False])
def test_text_offset_is_one_running_offset_whole_and_streamed(client, tokenizer, echo):
    max_tokens = 6
    request = {"prompt": PROMPTS, "n": 2, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
               "echo": echo, "ignore_eos": True}
    whole = _post(client, "/v1/completions", request)["choices"]
    assert len(whole) == 4
    for choice in whole:
        prompt = PROMPTS[choice["index"] // 2]
        lp = choice["logprobs"]
        n_prompt = len(tokenizer(prompt).input_ids) if echo else 0
        assert len(lp["tokens"]) == n_prompt + max_tokens
        assert lp["text_offset"] == running_offsets(lp["tokens"])
        generated = choice["text"][len(prompt):] if echo else choice["text"]
        assert "".join(lp["tokens"][n_prompt:]) == generated  # this prompt's tokens spell its text
        if echo:
            assert "".join(lp["tokens"][1:n_prompt]) == prompt  # after the BOS
    streamed: dict[int, dict] = {}
    for event in _events(client, "/v1/completions", request):
        for choice in event["choices"]:
            acc = streamed.setdefault(choice["index"], {"tokens": [], "text_offset": []})
            acc["tokens"] += choice["logprobs"]["tokens"]
            acc["text_offset"] += choice["logprobs"]["text_offset"]
    for choice in whole:
        got = streamed[choice["index"]]
        assert got["tokens"] == choice["logprobs"]["tokens"]
        assert got["text_offset"] == choice["logprobs"]["text_offset"]


def test_text_offset_indexes_the_echoed_text_of_a_token_id_prompt(client, tokenizer):
    """A token-id prompt echoes as its decoding (BOS included): the offsets index that text."""
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    for choice in _post(client, "/v1/completions", {"prompt": ids, "max_tokens": 5, "temperature": 0, "logprobs": 0,
                                                    "echo": True, "ignore_eos": True})["choices"]:
        lp, text = choice["logprobs"], choice["text"]
        assert len(lp["tokens"]) == len(ids[choice["index"]]) + 5
        for token, offset in zip(lp["tokens"], lp["text_offset"]):
            assert text[offset:offset + len(token)] == token
        assert lp["text_offset"][-1] + len(lp["tokens"][-1]) == len(text)


# -- tool_choice "required" cut off by max_tokens -------------------------------------------
def _streamed_message(events: list[dict]) -> tuple[str, dict[int, dict], str | None]:
    content, calls, finish = "", {}, None
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for d in delta.get("tool_calls", []):
                call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
                if "id" in d:
                    assert call["name"] is None
                    call["name"] = d["function"]["name"]
                call["arguments"] += d["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return content, calls, finish


def test_required_tool_choice_cut_off_by_max_tokens_whole_and_streamed_agree(client):
    names = {t["function"]["name"] for t in TOOLS}
    request = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": 3}
    full = _post(client, "/v1/chat/completions", {**request, "max_tokens": 200})
    assert full["choices"][0]["finish_reason"] == "tool_calls"
    full_tokens = full["usage"]["completion_tokens"]
    _, full_streamed, _ = _streamed_message(_events(client, "/v1/chat/completions", {**request, "max_tokens": 200}))
    cut_with_call = 0
    for max_tokens in range(2, min(full_tokens, 40)):
        body = _post(client, "/v1/chat/completions", {**request, "max_tokens": max_tokens})
        choice = body["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] == "length", (max_tokens, choice)
        assert message["content"] is None, (max_tokens, message)
        assert '"parameters"' not in json.dumps(message), (max_tokens, message)
        calls = message.get("tool_calls", [])
        assert all(c["function"]["name"] in names for c in calls)
        content, streamed, finish = _streamed_message(_events(client, "/v1/chat/completions",
                                                              {**request, "max_tokens": max_tokens}))
        assert finish == "length" and content == "", (max_tokens, content)
        assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls], max_tokens
        if calls:
            cut_with_call += 1
            # the same seed draws the same tokens: the cut calls are the start of the uncut ones
            for i, call in enumerate(calls):
                assert call["function"]["name"] == full_streamed[i]["name"]
                assert full_streamed[i]["arguments"].startswith(call["function"]["arguments"])
    assert cut_with_call > 0, "no max_tokens cut inside a call's arguments: widen the range"


@pytest.mark.parametrize("text", [
    '[{"name": "get_time", "parameters": {"zone": 3}}, {"name": "get_weather", "parameters": {"city": "P\\"a}',
    '[{"parameters": {"zone": [1, {"x": "]"}]}, "name": "get_time"}, {"parameters": {"zone": 2}, "name": "get_time"}]',
])
def test_every_cut_of_a_required_text_gives_what_its_stream_sent(text):
    """Every prefix (a cut anywhere): the calls begun in it, as the stream of that prefix sent
    them in pieces; a call shows once its name is whole, and "parameters" is never shown."""
    from pagedserve.structured.tools import RequiredCallStream, calls_from_required
    for end in range(len(text) + 1):
        cut = text[:end]
        stream, streamed = RequiredCallStream(), {}
        for start in range(0, end, 3):
            for d in stream.feed(cut[start:start + 3])[1]:
                call = streamed.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})
                call["arguments"] += d["function"]["arguments"]
        calls = calls_from_required(cut)
        if end == len(text) and text.endswith("]"):  # whole: re-serialized arguments, the same values
            assert [(c.name, json.loads(c.arguments)) for c in calls] == \
                [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed.items())]
            continue
        assert [(c.name, c.arguments) for c in calls] == \
            [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())]
        assert all("parameters" not in c.arguments for c in calls)
    if text.endswith("]"):  # parameters before the name: nothing until the name is whole
        name_end = text.index('"get_time"') + len('"get_time"')
        assert calls_from_required(text[:name_end - 1]) == []
        assert [(c.name, c.arguments) for c in calls_from_required(text[:name_end])] == \
            [("get_time", '{"zone": [1, {"x": "]"}]}')]
    else:  # cut inside the second call's string argument
        assert [(c.name, c.arguments) for c in calls_from_required(text)] == \
            [("get_time", '{"zone": 3}'), ("get_weather", '{"city": "P\\"a}')]
