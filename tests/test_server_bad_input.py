"""Bad input and overload: the right status and OpenAI error body, and no change to the engine."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from pagedserve.config import EngineConfig
from pagedserve.server.launcher import ServerThread, build_server

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=128, max_num_seqs=8)
    app, async_engine = build_server(config, api_key=KEY, max_queue_len=2)
    with ServerThread(app) as st:
        st.async_engine = async_engine
        yield st


@pytest.fixture(scope="module")
def model(server):
    return server.async_engine.engine.model_name


def engine_state(server) -> tuple:
    ae = server.async_engine
    e = ae.engine
    return (e.kv_cache_manager.num_used_blocks, e.block_pool.free_queue.num_free, e.scheduler.num_waiting,
            e.scheduler.num_running, len(e.output_processor.requests), ae.num_waiting, len(ae.client.inbox.pending()), len(ae._queues))


def post(server, path: str, body=None, headers=AUTH, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def check_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


CASES = [
    # (path, body, status, param)
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -3}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 500}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400,
     "temperature"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", CASES, ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_bad_parameters_are_400_and_change_nothing(server, model, path, body, status, param):
    before = engine_state(server)
    check_error(post(server, path, {"model": model, **body}), status, param)
    assert engine_state(server) == before


def test_malformed_json_is_400(server):
    before = engine_state(server)
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi", ', timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    check_error(r, 400, "body")
    r = httpx.post(server.url + "/v1/chat/completions", content=b"[1, 2]", timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400
    assert engine_state(server) == before


def test_prompt_plus_max_tokens_over_max_model_len_names_the_numbers(server, model):
    before = engine_state(server)
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    n = len(server.async_engine.engine.tokenize(prompt))
    err = check_error(post(server, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 120}),
                      400, "max_tokens")
    assert "128" in err["message"] and str(n + 120) in err["message"] and str(n) in err["message"]
    err = check_error(post(server, "/v1/completions", {"model": model, "prompt": [5] * 300}), 400, "prompt")
    assert "128" in err["message"] and "300" in err["message"]
    assert engine_state(server) == before


def test_unknown_model_is_404(server):
    before = engine_state(server)
    check_error(post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404, "model")
    check_error(post(server, "/v1/chat/completions",
                     {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404, "model")
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).completions.create(
            model="gpt-9", prompt="hi")
    assert engine_state(server) == before


def test_missing_or_wrong_api_key_is_401(server, model):
    before = engine_state(server)
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    check_error(post(server, "/v1/completions", body, headers={}), 401)
    check_error(post(server, "/v1/completions", body, headers={"Authorization": "Bearer nope"}), 401)
    check_error(httpx.get(server.url + "/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert engine_state(server) == before
    # the open endpoints stay open; the right key works
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert post(server, "/v1/completions", body).status_code == 200


def test_chat_without_template_is_400(server, model):
    tokenizer = server.async_engine.engine.tokenizer
    template = tokenizer.chat_template
    before = engine_state(server)
    tokenizer.chat_template = None
    try:
        err = check_error(post(server, "/v1/chat/completions",
                               {"model": model, "messages": [{"role": "user", "content": "x"}]}), 400, "messages")
    finally:
        tokenizer.chat_template = template
    assert "chat template" in err["message"]
    assert engine_state(server) == before


def test_full_waiting_queue_is_503_with_retry_after(server, model):
    """The engine thread is held so exactly two requests wait; the third is turned away."""
    ae = server.async_engine
    idle = engine_state(server)
    results: list[int] = []

    def call() -> None:
        results.append(post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}).status_code)

    ae.pause()
    try:
        waiting = [threading.Thread(target=call) for _ in range(2)]
        for t in waiting:
            t.start()
        end = time.monotonic() + 30
        while ae.num_waiting < 2 and time.monotonic() < end:
            time.sleep(0.02)
        assert ae.num_waiting == 2
        before = engine_state(server)
        r = post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2})
        check_error(r, 503)
        assert int(r.headers["Retry-After"]) >= 1
        r = post(server, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}]})
        check_error(r, 503)
        assert engine_state(server) == before
    finally:
        ae.resume()
    for t in waiting:
        t.join(60)
    assert results == [200, 200]
    end = time.monotonic() + 30
    while engine_state(server) != idle and time.monotonic() < end:
        time.sleep(0.02)
    assert engine_state(server) == idle


def test_failure_in_one_request_fails_only_that_request(server, model):
    """An exception while processing one request's output: that request gets a 500, the rest go on."""
    ae = server.async_engine
    original = ae._process_output
    failed = []
    boom = ae.engine.tokenize("boom")

    def flaky(queue, out):
        if out.prompt_token_ids == boom:
            failed.append(out.request_id)
            raise RuntimeError("injected failure")
        return original(queue, out)

    ae._process_output = flaky
    try:
        ok: list[int] = []
        t = threading.Thread(target=lambda: ok.append(post(
            server, "/v1/completions", {"model": model, "prompt": "fine", "max_tokens": 20,
                                        "ignore_eos": True}).status_code))
        t.start()
        r = post(server, "/v1/completions", {"model": model, "prompt": "boom", "max_tokens": 20})
        t.join(60)
    finally:
        ae._process_output = original
    err = check_error(r, 500)
    assert "injected failure" in err["message"]
    assert ok == [200] and len(failed) == 1
    end = time.monotonic() + 30
    while ae.engine.has_unfinished_requests() and time.monotonic() < end:
        time.sleep(0.02)
    assert not ae.engine.has_unfinished_requests() and ae.engine.kv_cache_manager.num_used_blocks == 0
    assert post(server, "/v1/completions", {"model": model, "prompt": "again", "max_tokens": 2}).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
