"""The uvicorn server `pagedserve serve` runs: the drain on a shutdown signal, the read
deadlines, and the end of the dashboard's event streams when the drain ends."""
from __future__ import annotations

from fastapi import FastAPI


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info", timeout_graceful_shutdown: int = 5,
                header_read_timeout: float | None = None, body_read_timeout: float | None = None):
    """A uvicorn.Server for `pagedserve serve`:
    - a shutdown signal (SIGTERM, SIGINT) drains first (server/drain.py: stop admitting, let the
      requests in flight finish up to --shutdown-timeout, end the rest with an error), a second
      one cuts the drain short, a third is uvicorn's own (exit now); a drained server exits 0;
    - the drain's end also ends the dashboard's event streams (a page never closes its own);
    - header and body read deadlines (server/read_timeouts.py; None = their defaults, 0 = off).
    `timeout_graceful_shutdown` only bounds uvicorn's own close after the drain."""
    import asyncio

    import uvicorn

    from pagedserve.server.read_timeouts import (DEFAULT_BODY_READ_TIMEOUT, DEFAULT_HEADER_READ_TIMEOUT,
                                                 protocol_with_read_timeouts)

    hub = getattr(app.state, "dashboard", None)  # dashboard/feed.py DashboardHub, when mounted
    drain = getattr(app.state, "drain", None)

    class _Server(uvicorn.Server):
        _loop = None
        _signals = 0

        async def startup(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame) -> None:
            self._signals += 1
            if drain is None or not self.started or self.should_exit or self._signals > 2:
                if hub is not None:
                    hub.close_all_threadsafe()
                return super().handle_exit(sig, frame)
            # Not recorded as uvicorn's captured signal: a drained server exits 0, not by the signal.
            self._loop.call_soon_threadsafe(drain.begin, self._drained)

        def _drained(self) -> None:
            if hub is not None:
                hub.close_all_threadsafe()
            self.should_exit = True

    protocol = protocol_with_read_timeouts(
        DEFAULT_HEADER_READ_TIMEOUT if header_read_timeout is None else header_read_timeout,
        DEFAULT_BODY_READ_TIMEOUT if body_read_timeout is None else body_read_timeout)
    return _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                                  timeout_graceful_shutdown=timeout_graceful_shutdown))
