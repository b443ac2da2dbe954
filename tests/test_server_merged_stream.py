"""A stream whose consumer falls behind gets the outputs that queued up meanwhile as one SSE
chunk (RequestHandling.results), and the merged stream still says exactly what the whole
answer says: per choice index, the deltas' text, logprobs (tokens, values, top, offsets, in
order) and finish equal the non-streamed answer to the same greedy request, usage too, for
several prompts with n=2 on /v1/completions (with a stop string) and on /v1/chat/completions.

The consumer is slowed in the one place a real slow client slows it: every body write waits
(an ASGI wrapper around the app), so the engine steps several times per chunk sent.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedserve.config import EngineConfig
from pagedserve.server.launcher import ServerThread, build_server

WRITE_DELAY_S = 0.02
MAX_TOKENS = 24


def slow_writes(app, delay: float):
    async def wrapped(scope, receive, send):
        async def slow_send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                await asyncio.sleep(delay)
            await send(message)
        await app(scope, receive, slow_send)
    return wrapped


@pytest.fixture(scope="module")
def client(tiny_llama):
    # No prefix caching: the streamed request repeats the whole one's prompt, and a prompt whose first
    # blocks are cached is attended by another kernel (the plan's, after cached keys) than a fresh one
    # (the tiled causal path): the same tokens, logprobs a few ulps apart. This test is about merging.
    app, _ = build_server(EngineConfig(model=str(tiny_llama), num_kv_blocks=256, max_model_len=256, max_num_seqs=8,
                                       enable_prefix_caching=False),
                          log_interval=0, dashboard=False)
    with ServerThread(slow_writes(app, WRITE_DELAY_S)) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield c


def _events(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def _whole(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _greedy(**extra) -> dict:
    return {"max_tokens": MAX_TOKENS, "temperature": 0, "n": 2, "ignore_eos": True, **extra}


def test_merged_completion_stream_equals_the_whole_answer(client):
    prompts = ["def fibonacci(n):", "The quick brown fox"]
    probe = _whole(client, "/v1/completions", {"prompt": prompts[0], **_greedy(n=1)})["choices"][0]["text"]
    stop = probe[len(probe) // 2:len(probe) // 2 + 2]  # a stop string the first prompt's answer reaches
    body = {"prompt": prompts, "logprobs": 2, "stop": [stop], **_greedy()}
    whole = _whole(client, "/v1/completions", body)
    assert whole["choices"][0]["finish_reason"] == "stop"
    events = _events(client, "/v1/completions", body)

    per_chunk = [len(c["logprobs"]["tokens"]) for e in events for c in e["choices"]]
    assert max(per_chunk) > 1, "the slow consumer never got a merged chunk"
    assert len(per_chunk) < whole["usage"]["completion_tokens"]
    streamed: dict[int, dict] = {}
    for e in events:
        assert e["object"] == "text_completion"
        for c in e["choices"]:
            s = streamed.setdefault(c["index"], {"text": "", "logprobs": {k: [] for k in c["logprobs"]},
                                                 "finish_reason": None})
            assert s["finish_reason"] is None, "a chunk came after the choice's finish"
            s["text"] += c["text"]
            for k, v in c["logprobs"].items():
                s["logprobs"][k] += v
            s["finish_reason"], s["stop_reason"] = c["finish_reason"], c["stop_reason"]
    assert sorted(streamed) == [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    for c in whole["choices"]:
        s = streamed[c["index"]]
        assert s["text"] == c["text"]
        assert s["logprobs"] == c["logprobs"]
        assert (s["finish_reason"], s["stop_reason"]) == (c["finish_reason"], c["stop_reason"])
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]


def test_merged_chat_stream_equals_the_whole_answer(client):
    body = {"messages": [{"role": "user", "content": "Write fibonacci."}], "logprobs": True, "top_logprobs": 2,
            **_greedy()}
    whole = _whole(client, "/v1/chat/completions", body)
    events = _events(client, "/v1/chat/completions", body)

    per_chunk = [len(c["logprobs"]["content"]) for e in events for c in e["choices"]]
    assert max(per_chunk) > 1, "the slow consumer never got a merged chunk"
    streamed: dict[int, dict] = {}
    for e in events:
        assert e["object"] == "chat.completion.chunk"
        for c in e["choices"]:
            first = c["index"] not in streamed
            s = streamed.setdefault(c["index"], {"content": "", "logprobs": [], "finish_reason": None})
            assert s["finish_reason"] is None, "a chunk came after the choice's finish"
            assert (c["delta"].get("role") == "assistant") == first
            s["content"] += c["delta"].get("content") or ""
            s["logprobs"] += c["logprobs"]["content"]
            s["finish_reason"] = c["finish_reason"]
    assert sorted(streamed) == [c["index"] for c in whole["choices"]] == [0, 1]
    for c in whole["choices"]:
        s = streamed[c["index"]]
        assert s["content"] == c["message"]["content"]
        assert s["logprobs"] == c["logprobs"]["content"]
        assert s["finish_reason"] == c["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
