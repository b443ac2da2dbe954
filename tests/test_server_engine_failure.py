"""The engine loop failing under a live server: requests in flight get an error (never a
hang: every wait here has a timeout), /health tells the truth, and nothing is served by an
engine whose state is unknown.

A step that raises is fatal, as in vLLM (an exception mid-step can leave the scheduler, the
pool or the device in a state nothing checked): every request in flight fails, /health answers
503 naming the error, new requests get 503 at once. Both an Exception and a BaseException (what
kills a loop that guards only against Exception) are injected through one helper,
`fail_engine_steps`, so an engine redesign adapts only that.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from pagedserve.config import EngineConfig
from pagedserve.server.launcher import ServerThread, build_server

TIMEOUT = httpx.Timeout(30.0)


class EngineCrash(BaseException):
    """Not an Exception: what kills a loop that only guards against Exception (as a fatal
    error in an engine process would)."""


def fail_engine_steps(server, error: BaseException, when_in_flight: int, times: int = 1) -> list[int]:
    """Once `when_in_flight` sequences are in the engine core (after at least one step for them),
    `times` steps raise `error`. Returns a one-item list counting the steps that raised.
    (The one place that knows how a step is run.)"""
    core = server.async_engine.engine_core
    step = core.step
    raised, stepped_with_all = [0], [False]

    def failing_step():
        if len(core.scheduler.requests) >= when_in_flight:
            if stepped_with_all[0] and raised[0] < times:
                raised[0] += 1
                raise error
            stepped_with_all[0] = True
        return step()

    core.step = failing_step
    return raised


def start_server(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=128, max_num_seqs=8)
    app, async_engine = build_server(config, log_interval=0)
    st = ServerThread(app).start()
    st.async_engine = async_engine
    return st


def in_flight(server, model: str) -> tuple[list, list[threading.Thread]]:
    """A non-streaming and a streaming request that would run 60 steps; their results land in
    the returned list as (kind, status code, body text)."""
    results: list = []
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 60, "ignore_eos": True}

    def plain():
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
        results.append(("plain", r.status_code, r.text))

    def streamed():
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                          timeout=TIMEOUT) as r:
            results.append(("stream", r.status_code, "\n".join(r.iter_lines())))

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    return results, threads


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request in flight hung after the engine failed"


@pytest.fixture
def server(tiny_llama):
    st = start_server(tiny_llama)
    try:
        yield st
    finally:
        st.stop()


@pytest.mark.parametrize("error", [RuntimeError("injected step failure"), EngineCrash("injected step failure")],
                         ids=["Exception", "BaseException"])
def test_a_failing_step_fails_the_requests_in_flight_and_health_reports_it(server, error):
    model = server.async_engine.engine.model_name
    raised = fail_engine_steps(server, error, when_in_flight=2)
    # The engine is held until both requests are in: on a loaded machine the first could
    # finish its 60 steps before the second arrives, and then no step has both in flight.
    server.async_engine.pause()
    results, threads = in_flight(server, model)
    deadline = time.monotonic() + 30
    while server.async_engine.num_waiting < 2:
        assert time.monotonic() < deadline, f"only {server.async_engine.num_waiting} of 2 requests arrived"
        time.sleep(0.02)
    server.async_engine.resume()
    join_all(threads)
    assert raised == [1]
    by_kind = {kind: (status, text) for kind, status, text in results}
    status, text = by_kind["plain"]
    assert status in (500, 503) and "injected step failure" in text
    status, text = by_kind["stream"]  # headers were sent: the error arrives as the last event
    assert status == 200 and "injected step failure" in text and text.rstrip().endswith("data: [DONE]")
    # The engine is dead: /health says so and why, and nothing new is queued for it.
    health = httpx.get(server.url + "/health", timeout=TIMEOUT)
    assert health.status_code == 503 and "injected step failure" in health.text
    r = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT,
                   json={"model": model, "prompt": "after", "max_tokens": 3})
    assert r.status_code == 503  # refused at once, not queued for a loop that will never run
