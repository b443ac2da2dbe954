"""Read deadlines for HTTP requests: a client that stalls while sending gets 408 and loses
its connection, instead of holding a socket and its buffers for as long as it likes.

    --header-read-timeout  the whole request line and headers must arrive within this many
                           seconds of the connection (or, on a kept-alive connection, of the
                           request's first byte)
    --body-read-timeout    while a body is expected, at most this many seconds between two
                           reads that bring bytes

The semantics are nginx's (`client_header_timeout`: the whole header; `client_body_timeout`:
"only for a period between two successive read operations, not for the transmission of the
whole request body"; both answer 408). uvicorn has no such timer (only `timeout_keep_alive`,
between requests), so this is its h11 protocol with one timer per connection. A body read
paused by uvicorn's own flow control (the app has not taken what came) does not count.
"""
from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.server.protocol import error_body

DEFAULT_HEADER_READ_TIMEOUT = 10.0
DEFAULT_BODY_READ_TIMEOUT = 30.0


def _timeout_response(message: str) -> bytes:
    body = json.dumps(error_body(408, message, "RequestTimeoutError")).encode()
    head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n")
    return head + body


class ReadTimeoutH11Protocol(H11Protocol):
    """uvicorn's H11Protocol with a header and a body read deadline (class attributes, set by
    `protocol_with_read_timeouts`; None = no deadline)."""

    header_read_timeout: float | None = None
    body_read_timeout: float | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._read_timer = None
        super().connection_made(transport)
        self._arm(self.header_read_timeout, self._headers_timed_out)  # a silent new connection too

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return self._disarm()
        state = self.conn.their_state
        if state is h11.IDLE:  # (part of) the next request's head
            if self._read_timer is None and data:
                self._arm(self.header_read_timeout, self._headers_timed_out)
        elif state is h11.SEND_BODY:  # headers complete: each read that brings bytes restarts the body timer
            self._disarm()
            self._arm(self.body_read_timeout, self._body_timed_out)
        else:  # the whole request is in (or the connection is ending): nothing to wait for
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is not h11.SEND_BODY:
            self._disarm()  # until the next request's first byte, keep-alive's own timer rules

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    # -- timers -----------------------------------------------------------------------
    def _arm(self, seconds: float | None, callback) -> None:
        if seconds:
            self._read_timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _headers_timed_out(self) -> None:
        self._read_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._reply_408_and_close(f"request headers: not received within {self.header_read_timeout:g} s "
                                      f"(--header-read-timeout)")

    def _body_timed_out(self) -> None:
        self._read_timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        if self.flow.read_paused:  # we stopped reading, not the client: wait again
            return self._arm(self.body_read_timeout, self._body_timed_out)
        cycle = self.cycle
        if cycle is not None and cycle.response_started:  # the app answered already: just close
            self.transport.close()
            return
        if cycle is not None:  # the app sees a disconnect; what it sends from now on is dropped
            cycle.disconnected = True
            cycle.message_event.set()
        self._reply_408_and_close(f"body: no bytes of the request body for {self.body_read_timeout:g} s "
                                  f"(--body-read-timeout)")

    def _reply_408_and_close(self, message: str) -> None:
        self.transport.write(_timeout_response(message))
        self.transport.close()


def protocol_with_read_timeouts(header_read_timeout: float | None, body_read_timeout: float | None) -> type:
    """The protocol class to give uvicorn.Config(http=...); a timeout of None or 0 is off."""
    for name, value in (("header_read_timeout", header_read_timeout), ("body_read_timeout", body_read_timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{name}: must be a number of seconds >= 0 (0 = no limit), got {value!r}")
    return type("ReadTimeoutH11Protocol", (ReadTimeoutH11Protocol,),
                {"header_read_timeout": header_read_timeout or None, "body_read_timeout": body_read_timeout or None})
