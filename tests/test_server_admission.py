"""Admission bounds with the server's defaults: one request may not queue more than
--max-seqs-per-request sequences (prompts x n), and the waiting queue has a bound even when
--max-queue-len is not given. A refusal changes nothing in the engine."""
from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest

from pagedserve.config import EngineConfig
from pagedserve.server.launcher import (DEFAULT_MAX_SEQS_PER_REQUEST, MIN_DEFAULT_MAX_QUEUE_LEN, ServerThread,
                                        build_server, resolve_admission)


@pytest.fixture(scope="module")
def server(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=128, max_num_seqs=8)
    app, async_engine = build_server(config)  # every admission knob at its default
    with ServerThread(app) as st:
        st.async_engine = async_engine
        yield st


def engine_state(server) -> tuple:
    ae = server.async_engine
    e = ae.engine
    return (e.kv_cache_manager.num_used_blocks, e.block_pool.free_queue.num_free, e.scheduler.num_waiting,
            e.scheduler.num_running, len(e.output_processor.requests), ae.num_waiting, len(ae.client.inbox.pending()),
            len(ae._queues))


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def check_400(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["param"] == param, err
    return err["message"]


@contextlib.contextmanager
def default_queue_filled(server, ae, hold, release, body: dict):
    """Hold the engine, send four requests of 256 sequences (`body`) that fill the default queue
    of 1,024, and wait until all of them wait; the block runs then. After it: release the engine
    and check that all four were served."""
    results: list[int] = []

    def call() -> None:
        results.append(post(server, body).status_code)

    hold()
    try:
        waiting = [threading.Thread(target=call) for _ in range(4)]
        for t in waiting:
            t.start()
        end = time.monotonic() + 60
        # counted at submit; in thread mode each request's message reaches the held core's inbox a moment later
        inbox = getattr(ae.client, "inbox", None)
        while (ae.num_waiting < 1024 or (inbox is not None and len(inbox.pending()) < 4)) and time.monotonic() < end:
            time.sleep(0.02)
        assert ae.num_waiting == 1024
        yield
    finally:
        release()
    for t in waiting:
        t.join(120)
    assert results == [200] * 4


def test_the_defaults():
    config = EngineConfig(model=None, max_num_seqs=128)
    assert resolve_admission(config, None, None) == (1024, 256)
    assert resolve_admission(EngineConfig(model=None, max_num_seqs=512), None, None) == (8 * 512, 256)
    assert resolve_admission(config, 0, 0) == (None, None)       # 0: no limit
    assert resolve_admission(config, 7, 3) == (7, 3)             # explicit values are kept as given
    assert resolve_admission(config, None, 5000) == (5000, 5000)  # the queue holds the largest request


def test_too_many_prompts_in_one_request_is_a_400_naming_the_numbers(server):
    idle = engine_state(server)
    n = DEFAULT_MAX_SEQS_PER_REQUEST + 1
    message = check_400(post(server, {"prompt": ["hi"] * n, "max_tokens": 1}), "prompt")
    assert f"{n} sequences ({n} prompts x n=1)" in message and "at most 256" in message
    assert "--max-seqs-per-request" in message
    assert engine_state(server) == idle
    # n x prompts counts: 40 prompts x 8 samples = 320 sequences, each factor allowed on its own
    message = check_400(post(server, {"prompt": [[5, 6, 7]] * 40, "n": 8, "max_tokens": 1}), "prompt")
    assert "320 sequences (40 prompts x n=8)" in message
    assert engine_state(server) == idle
    # 10,000 prompts: refused before any is tokenized, just the same
    message = check_400(post(server, {"prompt": ["a b c"] * 10_000, "max_tokens": 1}), "prompt")
    assert "10000 sequences" in message
    assert engine_state(server) == idle


def test_a_request_at_the_bound_is_served(server):
    r = post(server, {"prompt": [[5, 6]] * 32, "n": 8, "max_tokens": 1, "temperature": 0})  # 256 sequences
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == DEFAULT_MAX_SEQS_PER_REQUEST


def test_the_default_queue_bound_is_503_with_retry_after(server):
    """The engine is held; four requests of 256 sequences fill the default queue of 1,024; the
    next sequence is turned away with 503 + Retry-After and changes nothing."""
    ae = server.async_engine
    assert ae.max_queue_len == MIN_DEFAULT_MAX_QUEUE_LEN == 4 * DEFAULT_MAX_SEQS_PER_REQUEST
    idle = engine_state(server)
    with default_queue_filled(server, ae, ae.pause, ae.resume, {"prompt": [[5, 6]] * 256, "max_tokens": 1}):
        before = engine_state(server)
        r = post(server, {"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        assert int(r.headers["Retry-After"]) >= 1
        assert "1024 of 1024" in r.json()["error"]["message"]
        assert engine_state(server) == before
    end = time.monotonic() + 30
    while engine_state(server) != idle and time.monotonic() < end:
        time.sleep(0.02)
    assert engine_state(server) == idle


def test_explicit_bounds_are_kept_and_a_request_larger_than_the_queue_is_a_400(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=128, max_num_seqs=8)
    app, async_engine = build_server(config, max_queue_len=3, max_seqs_per_request=0)
    assert async_engine.max_queue_len == 3
    with ServerThread(app) as st:
        # larger than the whole queue: it could never be admitted, so not a 503 to retry forever
        message = check_400(post(st, {"prompt": ["hi"] * 4, "max_tokens": 1}), "prompt")
        assert "4 sequences" in message and "at most 3" in message and "--max-queue-len" in message
        message = check_400(post(st, {"prompt": "hi", "n": 4, "max_tokens": 1}), "n")
        assert "4 sequences (1 prompt x n=4)" in message
        assert post(st, {"prompt": ["hi"] * 3, "max_tokens": 1}).status_code == 200


def test_process_mode_the_same_bounds(tiny_llama):
    """The engine core in its own process: the same 400 (changing nothing in the core), and the
    default queue bound while the core is held (SIGSTOP: what was sent waits in its socket)."""
    import os
    import signal

    from metrics_scrape import wait_idle

    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=128, max_num_seqs=8)
    app, ae = build_server(config, engine_core_mode="process")
    with ServerThread(app) as st:
        before = wait_idle(st)
        check_400(post(st, {"prompt": [[5, 6]] * 300, "max_tokens": 1}), "prompt")
        after = wait_idle(st)
        for name in ("pagedserve:prompt_tokens_total{}", "pagedserve:num_requests_waiting{}",
                     "pagedserve:num_requests_running{}", "pagedserve:kv_cache_used_tokens{}"):
            assert after[name] == before[name], name
        core = ae.client.process.pid
        with default_queue_filled(st, ae, lambda: os.kill(core, signal.SIGSTOP), lambda: os.kill(core, signal.SIGCONT),
                                  {"prompt": [[5, 6]] * 256, "max_tokens": 1, "ignore_eos": True}):
            r = post(st, {"prompt": "hi", "max_tokens": 1})
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
            assert ae.num_waiting == 1024
        m = wait_idle(st)  # every block back, nothing left waiting (it fails on a deadline otherwise)
        assert m["pagedserve:request_success_total{finished_reason=length}"] == (
            before["pagedserve:request_success_total{finished_reason=length}"] + 1024)


def test_flags_and_yaml_keys(tmp_path, tiny_llama):
    from pagedserve.cli import build_parser
    from pagedserve.engine_args import engine_config_from_args
    from pagedserve.server.cli import server_settings

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-seqs-per-request: 64\nstep-watchdog-timeout: 30\nmax_queue_len: 0\n")
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama), "--config", str(cfg)])
    settings = server_settings(args)
    assert (settings["max_seqs_per_request"], settings["step_watchdog_timeout"], settings["max_queue_len"]) == (
        64, 30, 0)
    engine_config_from_args(args)  # the server's keys are not unknown engine knobs
    args = build_parser().parse_args(["serve", "--max-seqs-per-request", "8", "--step-watchdog-timeout", "2.5"])
    assert (server_settings(args)["max_seqs_per_request"], server_settings(args)["step_watchdog_timeout"]) == (8, 2.5)
    for flags, name in ((["--max-seqs-per-request", "-1"], "max_seqs_per_request"),
                        (["--step-watchdog-timeout", "-1"], "step_watchdog_timeout")):
        with pytest.raises(ValueError, match=name):
            server_settings(build_parser().parse_args(["serve", *flags]))
