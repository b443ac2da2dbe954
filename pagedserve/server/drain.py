"""Shutting down without losing work: the drain a SIGTERM (or Ctrl-C) starts.

    signal ─▶ draining: new API requests get 503 + Retry-After, /health 503 (a load balancer
              stops sending); requests already admitted run on
           ─▶ all of them done, or --shutdown-timeout seconds passed (a second signal: now):
              the rest end with an OpenAI error body (a stream: an error event, then [DONE]),
              requests still being tokenized are refused with 503
           ─▶ the responses are written; uvicorn closes the connections, the lifespan stops
              the engine (its process, its ranks); the process exits 0

vLLM's `--shutdown-timeout` is the model (docs.vllm.ai, Engine Arguments: "Shutdown timeout in
seconds. 0 = abort, >0 = wait"; vllm-project/vllm#34730): 0 here too ends every request in
flight at once, each with its error body. Its default is 0; pagedserve's is
DEFAULT_SHUTDOWN_TIMEOUT, below Kubernetes' default grace period (30 s) so that the requests
cut off still get their error before a SIGKILL could come.

"In flight" is counted per HTTP request on the API paths, from the moment the app sees it
(before tokenization) until its response is written, so a request between parsing and the
engine is neither lost nor refused half-way.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from pagedserve.server.protocol import RETRY_AFTER_SECONDS, error_body

logger = logging.getLogger("pagedserve.server")

DEFAULT_SHUTDOWN_TIMEOUT = 20.0
# After the cut-off: how long the error bodies get to be written before uvicorn closes anyway.
WRITE_GRACE_SECONDS = 5.0
API_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class Drain:
    """The server's shutdown state, shared by the admission middleware, /health and the signal."""

    def __init__(self, async_engine, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        if timeout < 0:
            raise ValueError(f"shutdown_timeout: must be >= 0 seconds, got {timeout!r}")
        self.async_engine = async_engine
        self.timeout = timeout
        self.draining = False
        self.in_flight = 0
        self._changed: asyncio.Event | None = None
        self._cut = False
        self._task: asyncio.Task | None = None

    # -- admission (the middleware) ------------------------------------------------------
    def message(self) -> str:
        return "the server is shutting down and accepts no new requests; retry on another replica"

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self._changed is not None:
            self._changed.set()

    # -- the shutdown itself ---------------------------------------------------------------
    def begin(self, on_done) -> None:
        """Start draining (on the event loop); `on_done()` runs once the last response is written."""
        if self.draining:
            self.cut_now()  # a second signal: do not wait any longer
            return
        self.draining = True
        self._changed = asyncio.Event()
        logger.info("shutting down: %d request(s) in flight; new requests get 503; waiting up to %.0f s "
                    "(--shutdown-timeout) for them to finish", self.in_flight, self.timeout)
        self._task = asyncio.get_running_loop().create_task(self._run(on_done))

    def cut_now(self) -> None:
        if self._changed is not None:
            self._cut = True
            self._changed.set()

    async def _run(self, on_done) -> None:
        try:
            deadline = time.monotonic() + self.timeout
            finished = await self._wait_idle(deadline)
            if not finished:
                n = self.in_flight
                logger.warning("shutting down: %d request(s) did not finish within %s; ending them with an error",
                               n, "the second signal" if self._cut else f"{self.timeout:.0f} s (--shutdown-timeout)")
                self.async_engine.stop_accepting(self._cut_message())
                await self._wait_idle(time.monotonic() + WRITE_GRACE_SECONDS, cuttable=False)
            else:
                logger.info("shutting down: every request in flight finished")
        except Exception:  # noqa: BLE001 - whatever happened, the server must still exit
            logger.exception("the drain failed; shutting down now")
        finally:
            on_done()

    def _cut_message(self) -> str:
        why = "a second shutdown signal came" if self._cut else \
            f"it did not finish within --shutdown-timeout ({self.timeout:g} s)"
        return f"the server is shutting down and ended this request: {why}; retry it on another replica"

    async def _wait_idle(self, deadline: float, cuttable: bool = True) -> bool:
        while self.in_flight > 0:
            if cuttable and self._cut:
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass
        return True


class DrainGate:
    """ASGI middleware: counts the API requests in flight, and refuses new ones while draining."""

    def __init__(self, app, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(API_PREFIXES):
            return await self.app(scope, receive, send)
        drain = self.drain
        if drain.draining:
            body = json.dumps(error_body(503, drain.message(), "ServiceUnavailableError")).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"retry-after", str(RETRY_AFTER_SECONDS).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            drain.leave()
