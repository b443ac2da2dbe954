"""Defects real clients and a hostile load found (issue 12 §2): each test fails on the code
that had the defect."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from metrics_scrape import scrape, wait_idle
from pagedserve.config import EngineConfig
from pagedserve.server.launcher import ServerThread, build_server

KEY = "sk-test"


@pytest.fixture(scope="module")
def server(tiny_llama):
    """A small pool (64 blocks of 16) so that 16 streams of n=2 preempt each other."""
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=256, max_num_seqs=32,
                          preemption_mode="recompute")
    app, async_engine = build_server(config, max_request_bytes=64 * 1024, enable_prompt_tokens_details=True)
    with ServerThread(app) as st:
        st.async_engine = async_engine
        yield st


@pytest.fixture(scope="module")
def keyed_server(tiny_llama):
    app, async_engine = build_server(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=256),
                                     api_key=KEY)
    with ServerThread(app) as st:
        yield st


@pytest.fixture(scope="module")
def model(server):
    return server.async_engine.engine.model_name


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def sse_events(server, path, body) -> list[dict]:
    events = []
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def check_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    return err


def test_streamed_usage_equals_tokens_streamed_for_n2_under_preemption(server, model):
    before = scrape(server)

    def one(i: int) -> tuple[int, int]:
        events = sse_events(server, "/v1/completions", {
            "model": model, "prompt": [5 + i, 6, 7, 8] * 8, "n": 2, "max_tokens": 72, "logprobs": 0,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
        streamed = sum(len(c["logprobs"]["tokens"]) for e in events for c in e["choices"] if c.get("logprobs"))
        return streamed, events[-1]["usage"]["completion_tokens"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    for streamed, reported in results:
        assert streamed == 144 and reported == streamed
    wait_idle(server)
    after = scrape(server)
    preempted = sum(v - before.get(k, 0) for k, v in after.items() if k.startswith("pagedserve:num_preemptions_total"))
    assert preempted > 0, "the pool was meant to force preemption"


def test_chat_stream_sends_the_role_with_the_first_token(server, model):
    events = sse_events(server, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True,
        "stream": True, "logprobs": True})
    first = events[0]["choices"][0]
    assert first["delta"].get("role") == "assistant"
    assert first["logprobs"]["content"], "the role chunk must carry the first generated token"
    assert sum("role" in e["choices"][0]["delta"] for e in events if e["choices"]) == 1


def test_min_tokens_holds_back_stop_strings(server, model):
    base = post(server, "/v1/completions", {"model": model, "prompt": "def f(x):", "max_tokens": 12,
                                             "temperature": 0, "ignore_eos": True}).json()["choices"][0]["text"]
    stop = base[0]  # the very first character generated: without min_tokens this stops at once
    r = post(server, "/v1/completions", {"model": model, "prompt": "def f(x):", "max_tokens": 12, "min_tokens": 10,
                                          "temperature": 0, "ignore_eos": True, "stop": [stop]}).json()
    assert r["usage"]["completion_tokens"] >= 10, r
    unbounded = post(server, "/v1/completions", {"model": model, "prompt": "def f(x):", "max_tokens": 12,
                                                  "temperature": 0, "ignore_eos": True, "stop": [stop]}).json()
    assert unbounded["choices"][0]["finish_reason"] == "stop" and unbounded["usage"]["completion_tokens"] < 10


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "n": None, "max_tokens": None, "temperature": None, "top_p": None,
                         "stream": None, "stream_options": None, "logprobs": None, "echo": None, "stop": None,
                         "seed": None, "presence_penalty": None, "frequency_penalty": None, "best_of": None,
                         "suffix": None, "logit_bias": None, "user": None, "min_tokens": None,
                         "ignore_eos": None, "include_stop_str_in_output": None, "priority": None}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": None}], "n": None,
                              "max_tokens": 4, "max_completion_tokens": None, "logprobs": None,
                              "top_logprobs": None, "stream": None, "temperature": None, "stop": None}),
])
def test_null_means_the_default(server, model, path, body):
    r = post(server, path, dict(body, model=model))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


def test_head_metrics_and_health(server):
    for path in ("/metrics", "/health"):
        r = httpx.head(server.url + path)
        assert r.status_code == 200 and r.content == b""


def post_raw_json(server, path, body) -> httpx.Response:
    """JSON as a client that escapes a lone surrogate sends it ("\\ud800"): valid JSON, invalid text."""
    return httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=60,
                      headers={"content-type": "application/json"})


def test_lone_surrogate_is_400_naming_the_field(server, model):
    check_error(post_raw_json(server, "/v1/completions", {"model": model, "prompt": "a\ud800b", "max_tokens": 2}),
                400, "prompt")
    check_error(post_raw_json(server, "/v1/chat/completions",
                              {"model": model, "messages": [{"role": "user", "content": "x\udfffy"}]}),
                400, "messages[0].content")


def test_invalid_utf8_body_gets_the_openai_error_shape(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "\xff\xfe", "max_tokens": 2}',
                   headers={"content-type": "application/json"}, timeout=60)
    check_error(r, 400, "body")


def test_strings_are_not_booleans(server, model):
    check_error(post(server, "/v1/completions", {"model": model, "prompt": "hi", "stream": "yes"}), 400, "stream")
    check_error(post(server, "/v1/completions", {"model": model, "prompt": "hi", "n": "2"}), 400, "n")


def test_auth_is_checked_before_the_body(keyed_server):
    r = httpx.post(keyed_server.url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    check_error(r, 401)
    ok = httpx.post(keyed_server.url + "/v1/completions", content=b"{not json", timeout=30,
                    headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"})
    check_error(ok, 400, "body")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_giant_prompt_is_413_and_costs_no_memory(server, model):
    """2 MB of prompt: refused before it is parsed or tokenized; the server's RSS (this
    process: the server runs in a thread here) does not keep what it would have cost."""
    giant = "x " * (1 << 20)
    rss0 = rss_bytes()
    for _ in range(3):
        check_error(post(server, "/v1/completions", {"model": model, "prompt": giant, "max_tokens": 2}), 413, "body")
    assert rss_bytes() - rss0 < 32 << 20
    assert httpx.get(server.url + "/health").status_code == 200


@contextmanager
def slow_tokenize(server, stall):
    """The server's tokenizer calls stall() before tokenizing the text "slow prompt"."""
    processor = server.async_engine.engine.input_processor
    original = processor.tokenize

    def tokenize(text, *args, **kwargs):
        if text == "slow prompt":
            stall()
        return original(text, *args, **kwargs)

    processor.tokenize = tokenize
    try:
        yield
    finally:
        processor.tokenize = original


def test_tokenization_runs_off_the_event_loop(server, model):
    """While one request's tokenization is stuck, the server still answers others."""
    entered, release = threading.Event(), threading.Event()

    def stall():
        entered.set()
        assert release.wait(60)

    try:
        with slow_tokenize(server, stall), ThreadPoolExecutor(1) as pool:
            slow = pool.submit(post, server, "/v1/completions", {"model": model, "prompt": "slow prompt",
                                                                  "max_tokens": 2})
            assert entered.wait(60)
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200
            assert not slow.done()
            release.set()
            assert slow.result(timeout=60).status_code == 200
    finally:
        release.set()


@pytest.mark.parametrize("stream", [False, True])
def test_ttft_and_e2e_count_from_the_http_request_not_the_engine_hand_off(server, model, stream):
    """A client waits for parsing and tokenizing too: a prompt whose tokenizing takes 0.4 s adds
    at least that to the server's TTFT and E2E latency (it once counted from the hand-off to the
    engine and read faster than every client)."""
    delay = 0.4
    wait_idle(server)
    before = scrape(server)
    with slow_tokenize(server, lambda: time.sleep(delay)):
        body = {"model": model, "prompt": "slow prompt", "max_tokens": 2, "stream": stream}
        if stream:
            assert sse_events(server, "/v1/completions", body)
        else:
            assert post(server, "/v1/completions", body).status_code == 200
    after = wait_idle(server)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        count = f"pagedserve:{name}_count{{}}"
        total = f"pagedserve:{name}_sum{{}}"
        assert after[count] - before[count] == 1, name
        assert after[total] - before[total] >= delay, (name, after[total] - before[total])


def test_cached_tokens_in_usage(server, model, tiny_llama):
    prompt = list(range(10, 10 + 70))  # 4 full blocks of 16 + 6
    first = post(server, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2}).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    again = post(server, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2}).json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    events = sse_events(server, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2,
                                                    "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
