"""Shutting a real `pagedserve serve` down (a subprocess) with requests in flight.

On SIGTERM or SIGINT the server drains (server/drain.py): a new request gets an OpenAI-shaped
503 with Retry-After, /health answers 503, the requests in flight finish (200, full usage) if
they can within --shutdown-timeout, and the rest end with an OpenAI error body (a stream: an
error event, then `data: [DONE]`); the server exits 0 and logs no ASGI exception. Checked in
thread mode, process mode (the engine core in its own process) and with two tensor-parallel
ranks. Every wait has a deadline; no assertion is about how long anything took.
"""
from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest

from test_scaleout_faults import Served, alive, wait_gone

# The tiny model decodes ~1 token/ms: six requests, one at a time, take a few seconds (tp=2's
# steps, over gloo, are slower: fewer tokens keep it as long in flight).
MAX_TOKENS = {"thread": 600, "process": 600, "tp2": 150}
NUM_REQUESTS = 6  # half streamed, half not
DEADLINE = 120.0
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from checkpoints import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("shutdown"), "llama")


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^pagedserve:{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _request(url: str, stream: bool, max_tokens: int, results: list) -> None:
    """One completion of max_tokens tokens; appends (kind, status, body text or SSE data, headers)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    timeout = httpx.Timeout(DEADLINE, connect=10)
    try:
        if not stream:
            r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
            results.append(("plain", r.status_code, r.text, dict(r.headers)))
            return
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
            results.append(("stream", r.status_code, lines, dict(r.headers)))
    except httpx.HTTPError as e:  # a cut connection is a lost request: the assertions name it
        results.append(("lost", None, f"{type(e).__name__}: {e}", {}))


def _in_flight(server: Served, max_tokens: int) -> tuple[list, list[threading.Thread], int]:
    """NUM_REQUESTS requests sent, each in the engine (one running, the rest waiting: --max-num-seqs
    1) or, on a slow start, already done; returns (results, threads, number in the engine)."""
    results: list = []
    threads = [threading.Thread(target=_request, args=(server.url, i % 2 == 1, max_tokens, results))
               for i in range(NUM_REQUESTS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        queued = int(_metric(server.url, "num_requests_running") + _metric(server.url, "num_requests_waiting"))
        if queued + len(results) >= NUM_REQUESTS and queued >= NUM_REQUESTS // 2:
            return results, threads, queued
        time.sleep(0.02)
    pytest.fail(f"the requests were not in flight in time: {_summary(results)}")


def _summary(results: list) -> list:
    return [(kind, status, (payload if isinstance(payload, str) else "\n".join(payload[-3:]))[-400:])
            for kind, status, payload, *_ in results]


def _complete(kind: str, status, payload, max_tokens: int) -> bool:
    """A request that finished: 200 and usage counting every token asked for."""
    if status != 200:
        return False
    if kind == "plain":
        body = json.loads(payload)
        return body["usage"]["completion_tokens"] == max_tokens and body["choices"][0]["finish_reason"] == "length"
    events = [json.loads(e) for e in payload[:-1]]
    return (payload[-1] == "[DONE]" and events[-1]["usage"]["completion_tokens"] == max_tokens
            and events[-2]["choices"][0]["finish_reason"] == "length")


def _cut_properly(kind: str, status, payload, headers) -> bool:
    """A request ended by the shutdown: an OpenAI error body (503, Retry-After), or a stream whose
    last event is that error, then [DONE]."""
    if kind == "plain":
        if status != 503:  # done before the cut (checked by _complete), or wrong
            return False
        error = json.loads(payload)["error"]
        return (status == 503 and error["type"] == "ServiceUnavailableError" and error["code"] == 503
                and "shutting down" in error["message"] and headers.get("retry-after") is not None)
    if status != 200 or len(payload) < 2 or payload[-1] != "[DONE]":
        return False
    error = json.loads(payload[-2]).get("error")
    return error is not None and error["code"] == 503 and "shutting down" in error["message"]


def _start(tmp_path, model, mode: str, timeout: float) -> Served:
    flags = ["--shutdown-timeout", str(timeout), "--max-num-seqs", "1", "--max-model-len", "1024",
             "--num-kv-blocks", "256"]
    if mode == "process":
        flags += ["--engine-core-mode", "process"]
    elif mode == "tp2":
        flags += ["--engine-core-mode", "process", "--tensor-parallel-size", "2"]
    else:
        flags += ["--engine-core-mode", "thread"]
    return Served(tmp_path, model, *flags)


def _startup_heaps_frozen(log: str, mode: str) -> None:
    """Every long-lived process of the server froze its startup heap (utils.freeze_startup_heap:
    a full collection over it stalled a step or an SSE write ~0.5 s): the API process, the engine
    core in its own process, each tensor-parallel rank."""
    frozen = re.findall(r"(api server|engine core \d+|rank \d+): (\d+) startup objects frozen", log)
    who = {name for name, n in frozen if int(n) > 10_000}  # the model's process holds ~350,000
    expected = {"api server"} | ({"engine core 0"} if mode != "thread" else set()) | (
        {"rank 0", "rank 1"} if mode == "tp2" else set())
    assert expected <= who, f"frozen: {frozen}; expected {sorted(expected)}\n{log[-3000:]}"


def _exit_clean(server: Served, pids: list[int]) -> None:
    code = server.wait_exit()
    log = server.log()
    assert code == 0, f"exit status {code}:\n{log[-3000:]}"
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log[-3000:]
    assert not wait_gone(pids), f"processes left behind: {[p for p in pids if alive(p)]}"


@pytest.mark.parametrize("mode,sig", [("thread", signal.SIGTERM), ("process", signal.SIGINT), ("tp2", signal.SIGTERM)],
                         ids=["thread-SIGTERM", "process-SIGINT", "tp2-SIGTERM"])
def test_shutdown_signal_refuses_new_requests_and_lets_those_in_flight_finish(tmp_path, model, mode, sig):
    server = _start(tmp_path, model, mode, timeout=DEADLINE)
    try:
        pids = server.tree()
        if mode == "tp2":  # every process of the group is watched: API, engine core, two ranks
            assert len(pids) >= 4, pids
        results, threads, _ = _in_flight(server, MAX_TOKENS[mode])
        server.proc.send_signal(sig)
        # Draining: /health says so (once the signal is handled), a new request is refused as a
        # full queue refuses one.
        deadline = time.monotonic() + 30
        while (health := httpx.get(server.url + "/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "/health still answers 200 after the signal"
            time.sleep(0.02)
        assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
        r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=10)
        assert r.status_code == 503, r.text
        assert r.headers.get("retry-after") is not None
        error = r.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
        assert "shutting down" in error["message"]
        for t in threads:
            t.join(DEADLINE)
        assert not any(t.is_alive() for t in threads), "a request in flight hung"
        _exit_clean(server, pids)
        _startup_heaps_frozen(server.log(), mode)
    finally:
        if server.proc.poll() is None:
            server.kill()
    assert len(results) == NUM_REQUESTS
    unfinished = [r for r in results if not _complete(*r[:3], MAX_TOKENS[mode])]
    assert not unfinished, _summary(unfinished)


@pytest.mark.parametrize("mode,sig", [("thread", signal.SIGINT), ("process", signal.SIGTERM)],
                         ids=["thread-SIGINT", "process-SIGTERM"])
def test_shutdown_timeout_ends_the_unfinished_requests_with_an_error(tmp_path, model, mode, sig):
    """--shutdown-timeout 0 (vLLM's "abort"): nothing in flight may finish; each gets its error."""
    server = _start(tmp_path, model, mode, timeout=0)
    try:
        pids = server.tree()
        results, threads, in_flight = _in_flight(server, MAX_TOKENS[mode])
        server.proc.send_signal(sig)
        for t in threads:
            t.join(DEADLINE)
        assert not any(t.is_alive() for t in threads), "a request in flight hung"
        _exit_clean(server, pids)
        log = server.log()
    finally:
        if server.proc.poll() is None:
            server.kill()
    assert len(results) == NUM_REQUESTS
    # Those done before the signal are complete; the one running at the signal may still finish
    # between the signal and the cut (its last tokens a step away); the waiting ones cannot:
    # each of them is cut.
    cut = [r for r in results if _cut_properly(*r)]
    wrong = [r for r in results if r not in cut and not _complete(*r[:3], MAX_TOKENS[mode])]
    assert not wrong, _summary(wrong)
    assert len(cut) >= in_flight - 1, (in_flight, _summary(results))
    assert "did not finish" in log, log[-3000:]


def test_shutdown_and_read_timeout_settings_from_flags_and_yaml(tmp_path):
    from pagedserve.cli import build_parser
    from pagedserve.server.cli import server_settings

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("shutdown-timeout: 3\nheader_read_timeout: 4\n")
    settings = server_settings(build_parser().parse_args(["serve", "--config", str(cfg), "--body-read-timeout", "0"]))
    assert (settings["shutdown_timeout"], settings["header_read_timeout"], settings["body_read_timeout"]) == (3, 4, 0)
    for flag in ("--shutdown-timeout", "--header-read-timeout", "--body-read-timeout"):
        with pytest.raises(ValueError, match=flag[2:].replace("-", "_")):
            server_settings(build_parser().parse_args(["serve", flag, "-1"]))
