"""The step watchdog: an engine that is alive but makes no progress turns /health 503, naming
the stuck process, and counts a stall; when it steps again /health is 200 and the request in
flight completes as it would have.

- thread mode: the executor is held inside a step (in-process);
- process mode: the engine-core process is SIGSTOPped, then SIGCONTed;
- tensor parallel (tp=2): a non-driver rank is SIGSTOPped; /health names rank 1 and its pid.

Every wait has a deadline; nothing asserts a duration.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from pagedserve.config import EngineConfig
from pagedserve.server.launcher import ServerThread, build_server

DEADLINE = 60.0
# The watchdog's bound here: far above a tiny model's step (milliseconds), even on a loaded
# machine, so only the frozen engine trips it.
BOUND = 2.0
# Long enough (within the servers' 128-token context) that the engine is still generating when
# the test freezes it after the first token arrives: 48 tokens took less than the first token's
# trip to the client on the tiny model once the forward ran as one native call (the request was
# done before the freeze).
BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 120, "temperature": 0, "ignore_eos": True}


def stream(url: str, out: dict, first_token: threading.Event) -> None:
    """One streamed completion; out["text"] its text, out["status"] "ok" or what went wrong."""
    text = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True},
                          timeout=httpx.Timeout(DEADLINE * 3, connect=5)) as r:
            if r.status_code != 200:
                out["status"] = f"HTTP {r.status_code}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["status"] = f"error: {chunk}"
                    return
                text.append(chunk["choices"][0]["text"])
                first_token.set()
        out["status"] = "ok"
    except httpx.HTTPError as e:
        out["status"] = f"{type(e).__name__}: {e}"
    finally:
        out["text"] = "".join(text)
        first_token.set()


def health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=10)


def wait_health(url: str, status: int) -> httpx.Response:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        try:
            r = health(url)
            if r.status_code == status:
                return r
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"/health did not answer {status} within {DEADLINE:.0f} s")


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0]
        if name in ("pagedserve:engine_stalls_total", "pagedserve:engine_stalled"):
            out[name] = float(value)
    return out


def reference_text(url: str) -> str:
    r = httpx.post(url + "/v1/completions", json=BODY, timeout=DEADLINE)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def stall_and_recover(url: str, freeze, thaw) -> tuple[dict, dict, dict, dict]:
    """Start a streamed request, freeze the engine after its first token, wait for /health
    503, read it and the metrics, thaw, wait for /health 200. Returns (stalled /health error,
    metrics while stalled, metrics after, the stream's result)."""
    assert health(url).status_code == 200
    assert scrape(url) == {"pagedserve:engine_stalls_total": 0.0, "pagedserve:engine_stalled": 0.0}
    out: dict = {}
    first = threading.Event()
    t = threading.Thread(target=stream, args=(url, out, first))
    t.start()
    assert first.wait(DEADLINE), "no token came"
    freeze()
    try:
        stalled = wait_health(url, 503).json()["error"]
        during = scrape(url)
    finally:
        thaw()
    wait_health(url, 200)
    t.join(DEADLINE * 3)
    assert not t.is_alive(), "the request did not finish after the engine resumed"
    return stalled, during, scrape(url), out


def check_stall_report(stalled: dict, during: dict, after: dict, out: dict, reference: str) -> None:
    assert stalled["code"] == 503 and stalled["type"] == "ServiceUnavailableError"
    assert stalled["reason"] == "engine_stalled"
    assert "no engine step has completed for" in stalled["message"]
    assert "1 request in flight" in stalled["message"] and "--step-watchdog-timeout" in stalled["message"]
    assert stalled["stalled_seconds"] > stalled["bound_seconds"] == BOUND
    assert during == {"pagedserve:engine_stalls_total": 1.0, "pagedserve:engine_stalled": 1.0}
    assert after == {"pagedserve:engine_stalls_total": 1.0, "pagedserve:engine_stalled": 0.0}
    assert out["status"] == "ok", out
    assert out["text"] == reference  # the stall changed nothing in what was generated


# -- the derived bound ------------------------------------------------------------------------
def test_the_default_bound_follows_the_measured_steps():
    from types import SimpleNamespace

    from pagedserve.engine.async_llm import (STALL_FLOOR_SECONDS, STALL_MARGIN, STALL_WARMUP_SECONDS, AsyncLLM)

    engine = SimpleNamespace(output_processor=SimpleNamespace(), config=SimpleNamespace(max_num_batched_tokens=2048))
    client = SimpleNamespace(initial_snapshot=lambda: None)
    ae = AsyncLLM(engine, client=client)
    assert ae.watchdog_bound == STALL_WARMUP_SECONDS == 60  # nothing measured yet: the first steps may compile
    ae.observe_step(0.005, 4)         # a 4-token step: a full 2,048-token chunk extrapolates to 2.56 s
    assert ae.watchdog_bound == pytest.approx(STALL_MARGIN * 0.005 * 2048 / 4) == pytest.approx(25.6)
    ae.observe_step(0.2, 512)         # a larger step is the better basis: 0.8 s a full chunk, under the floor
    assert ae.watchdog_bound == STALL_FLOOR_SECONDS == 10
    ae.observe_step(3.0, 1)           # a slow step of few tokens (a long decode batch): 10 x 3 s
    assert ae.watchdog_bound == pytest.approx(30.0)
    assert AsyncLLM(engine, client=client, step_watchdog_timeout=2.5).watchdog_bound == 2.5
    assert AsyncLLM(engine, client=client, step_watchdog_timeout=0).watchdog_bound is None  # off


# -- thread mode ----------------------------------------------------------------------------
def test_thread_mode_a_step_that_never_ends_is_a_stall(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=128, max_num_seqs=4)
    app, async_engine = build_server(config, step_watchdog_timeout=BOUND)
    executor = async_engine.engine_core.executor
    execute = executor.execute
    hold, held, release = threading.Event(), threading.Event(), threading.Event()

    def held_execute(out):
        if hold.is_set():
            held.set()
            release.wait(DEADLINE * 3)
        return execute(out)

    executor.execute = held_execute
    with ServerThread(app) as st:
        reference = reference_text(st.url)
        # no work: a silent engine is not a stalled one (the client is held, nothing posts)
        async_engine.pause()
        time.sleep(BOUND + 0.5)
        assert health(st.url).status_code == 200
        async_engine.resume()

        def freeze():
            hold.set()
            assert held.wait(DEADLINE)

        def thaw():
            hold.clear()
            release.set()

        stalled, during, after, out = stall_and_recover(st.url, freeze, thaw)
    check_stall_report(stalled, during, after, out, reference)
    assert stalled["rank"] is None and stalled["pid"] is None and stalled["suspects"] == []
    assert "the engine thread is inside one step longer than the bound" in stalled["message"]


# -- process mode and tensor parallel (a real `pagedserve serve`) ---------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from checkpoints import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("watchdog"), "llama")


def test_process_mode_a_stopped_engine_core_is_a_stall(tmp_path, model):
    from test_scaleout_faults import Served, _core_pid

    server = Served(tmp_path, model, "--engine-core-mode", "process", "--step-watchdog-timeout", str(BOUND))
    core = _core_pid(server)
    try:
        reference = reference_text(server.url)
        stalled, during, after, out = stall_and_recover(server.url, lambda: os.kill(core, signal.SIGSTOP),
                                                        lambda: os.kill(core, signal.SIGCONT))
        assert server.proc.poll() is None  # a stall is not fatal
    finally:
        os.kill(core, signal.SIGCONT)
        server.kill()
    check_stall_report(stalled, during, after, out, reference)
    assert stalled["pid"] == core and stalled["rank"] is None
    assert f"the engine core process (pid {core}) is stopped (SIGSTOP)" in stalled["message"]
    log = server.log()
    assert "engine stalled" in log and "stepped again" in log, log[-3000:]


def test_tensor_parallel_a_stopped_rank_is_a_stall_naming_it(tmp_path, model):
    from test_scaleout_faults import Served, _rank_pids

    server = Served(tmp_path, model, "--tensor-parallel-size", "2", "--engine-core-mode", "process",
                    "--step-watchdog-timeout", str(BOUND))
    rank1 = _rank_pids(server)[1]
    try:
        reference = reference_text(server.url)
        stalled, during, after, out = stall_and_recover(server.url, lambda: os.kill(rank1, signal.SIGSTOP),
                                                        lambda: os.kill(rank1, signal.SIGCONT))
        assert server.proc.poll() is None
    finally:
        os.kill(rank1, signal.SIGCONT)
        server.kill()
    check_stall_report(stalled, during, after, out, reference)
    assert stalled["rank"] == 1 and stalled["pid"] == rank1
    assert f"tensor-parallel rank 1 (pid {rank1}) is stopped (SIGSTOP)" in stalled["message"]
