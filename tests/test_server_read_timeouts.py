"""Read deadlines: a client that stalls while sending a request gets 408 and its connection is
closed (nginx's client_header_timeout / client_body_timeout semantics); everyone else is served.

Raw sockets on loopback against a live server with 1 s deadlines. Each wait for the server's
answer has a generous socket timeout: what is asserted is what the server sends and that it
closes, never how fast.
"""
from __future__ import annotations

import json
import socket

import httpx
import pytest

from pagedserve.config import EngineConfig
from pagedserve.server.launcher import ServerThread, build_server

DEADLINE = 1.0
WAIT = 30.0  # far beyond the deadline: a server without one leaves the test failing here


@pytest.fixture(scope="module")
def server(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=128, max_num_seqs=4)
    app, _ = build_server(config, log_interval=0, dashboard=False)
    st = ServerThread(app, header_read_timeout=DEADLINE, body_read_timeout=DEADLINE).start()
    try:
        yield st
    finally:
        st.stop()


def _connect(server) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=WAIT)
    return s


def _read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def _assert_408(data: bytes, field: str) -> None:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data[:200]
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == 408 and error["type"] == "RequestTimeoutError"
    assert error["message"].startswith(field), error


def _completion(server) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=WAIT,
                      json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})


def test_half_sent_headers_get_408_and_the_connection_closes(server):
    with _connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
        _assert_408(_read_until_closed(s), "request headers")


def test_a_connection_that_sends_nothing_is_closed(server):
    with _connect(server) as s:
        _assert_408(_read_until_closed(s), "request headers")


def test_headers_without_the_promised_body_get_408(server):
    with _connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n")
        _assert_408(_read_until_closed(s), "body")


def test_a_body_that_stops_half_way_gets_408(server):
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 3}).encode()
    with _connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:10])
        _assert_408(_read_until_closed(s), "body")


def test_stalled_connections_do_not_stop_others_being_served_and_a_kept_alive_one_keeps_working(server):
    stalled = [_connect(server) for _ in range(20)]
    try:
        for i, s in enumerate(stalled):
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" if i % 2 else
                      b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 50\r\n\r\n")
        # A normal client on one kept-alive connection: two requests, the second after the
        # first's response (a request's deadline starts with its own first byte).
        with httpx.Client(timeout=WAIT) as client:
            for _ in range(2):
                r = client.post(server.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        for i, s in enumerate(stalled):
            _assert_408(_read_until_closed(s), "request headers" if i % 2 else "body")
    finally:
        for s in stalled:
            s.close()
    assert _completion(server).status_code == 200


def test_read_timeouts_are_checked():
    from pagedserve.server.read_timeouts import protocol_with_read_timeouts

    with pytest.raises(ValueError, match="header_read_timeout"):
        protocol_with_read_timeouts(-1, 5)
    with pytest.raises(ValueError, match="body_read_timeout"):
        protocol_with_read_timeouts(5, "soon")
    off = protocol_with_read_timeouts(0, 0)
    assert off.header_read_timeout is None and off.body_read_timeout is None
