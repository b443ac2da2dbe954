"""`/dashboard`: the KV pool block by block, the engine over time, the live requests and the
advisor's verdict, pushed to the page over server-sent events.

    GET /dashboard                 the page (static/dashboard.html; every asset ships in the package)
    GET /dashboard/static/<file>   its script and stylesheet
    GET /dashboard/events          SSE: one `init` message (history, latest snapshot), then frames
    GET /dashboard/state           the `init` message as JSON (scripts, tests)

Access follows /metrics: public, also when --api-key is set (the gate guards /v1/ and the
tokenizer routes). The page shows what /metrics shows plus request ids, token counts and
block ownership; never a prompt or an output. A server reachable by people who should not
see that runs with --no-dashboard.

While no page is connected, the engine-core loop takes no pool snapshots (PoolWatch tells it
how many pages watch, in either engine-core mode); the front-end's loop still folds each step
into the time series (a few additions per step), so a page opened later has the history.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from pagedserve.dashboard.feed import DashboardHub, DashboardInfo, LiveAdvisor, LiveSeries

STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
KEEPALIVE_S = 15.0


def _static(name: str) -> bytes:
    return resources.files("pagedserve.dashboard").joinpath("static", name).read_bytes()


def add_dashboard_routes(app: FastAPI, hub: DashboardHub) -> None:
    page = _static("dashboard.html")
    assets = {name: (_static(name), media) for name, media in STATIC_FILES.items()}

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page():
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_asset(name: str):
        if name not in assets:
            return Response(status_code=404)
        body, media = assets[name]
        return Response(body, media_type=media, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/state", include_in_schema=False)
    async def dashboard_state():
        return JSONResponse(hub.state())

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events():
        return StreamingResponse(_events(hub), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(hub: DashboardHub):
    client = hub.connect()
    try:
        while True:
            try:
                await asyncio.wait_for(client.event.wait(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield ": keep-alive\n\n"  # a comment: also how a gone client is noticed
                continue
            client.event.clear()
            if client.closed:
                return
            messages, client.pending = client.pending, []
            for message in messages:
                yield f"data: {message}\n\n"
    finally:
        hub.disconnect(client)


@dataclass
class PoolWatch:
    """The front-end's side of the pool view's gate: counts the pages that watch and sends the
    count, with the rate and CPU-share bounds, to the engine-core loop, whose gate
    (core/snapshot.py SnapshotGate) decides when a snapshot is due."""

    client: object            # engine/core_client.py CoreClient
    max_rate: float = 4.0
    max_share: float = 0.01
    watchers: int = 0

    def add_watcher(self) -> None:
        self.watchers += 1
        self._send()

    def remove_watcher(self) -> None:
        self.watchers = max(self.watchers - 1, 0)
        self._send()

    def _send(self) -> None:
        try:
            self.client.watch_pool(self.watchers, self.max_rate, self.max_share)
        except Exception:  # noqa: BLE001 - a gone core: the page shows what it has
            pass


def mount_dashboard(app: FastAPI, async_engine, max_snapshot_rate: float = 4.0,
                    point_interval: float = 0.5) -> DashboardHub:
    """Serve the dashboard for `async_engine` (an AsyncLLM, before it starts), whichever way
    its core runs: the core's loop sends pool snapshots while pages watch, the front-end's
    loop feeds every step and snapshot to the hub."""
    engine = async_engine.engine
    layout = async_engine.client.pool_layout()
    config = engine.config
    info = DashboardInfo(model=engine.model_name, num_blocks=layout.num_blocks, block_size=layout.block_size,
                         num_host_blocks=layout.num_host_blocks,
                         max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                         preemption_mode=str(config.preemption_mode))
    gate = PoolWatch(async_engine.client, max_rate=max_snapshot_rate)
    metrics = async_engine.metrics
    advisor = LiveAdvisor(metrics.render) if metrics is not None else None
    hub = DashboardHub(info, gate, advisor, LiveSeries(point_interval=point_interval))
    async_engine.pool_snapshots = gate
    async_engine.step_listeners.append(hub.ingest)
    async_engine.snapshot_listeners.append(hub.ingest_snapshot)
    add_dashboard_routes(app, hub)
    app.state.dashboard = hub
    return hub
