"""`pagedserve simulate --dashboard`: a simulated run, replayed into the server's own
dashboard page at a chosen speed, so a planned deployment can be watched before it exists.

    replay thread                                   event loop (uvicorn)
    simulate(on_step=..., pool_snapshots=gate)
      each step: sleep until start + t_virtual/speed
      ─ call_soon_threadsafe ─────────────────────▶ SimMetricsFeeder (an EngineMetrics, as /metrics)
                                                    DashboardHub.ingest (series, pool, advisor) ─▶ pages

The simulator drives the engine's own EngineCore, so the steps, stats and pool snapshots
are the ones a server would produce; only the clock is virtual. The page's time axis and
rates are in simulated seconds. The replay starts when the first page connects, so the
run is watched from its first step; the page stays up after the run until Ctrl-C.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from contextlib import asynccontextmanager
from typing import Callable, Sequence

from pagedserve.core.outputs import EngineCoreOutputs, RequestMetrics
from pagedserve.core.snapshot import PoolSnapshot, SnapshotGate
from pagedserve.dashboard.feed import DashboardHub, DashboardInfo, LiveAdvisor, LiveSeries
from pagedserve.dashboard.routes import add_dashboard_routes
from pagedserve.metrics import CONTENT_TYPE, EngineMetrics

logger = logging.getLogger("pagedserve.sim")


class SimMetricsFeeder:
    """Records simulated steps into an EngineMetrics the way the server's front-end records
    real ones (engine/async_llm.py and the output processor), so the advisor reads the same
    metric families from a simulation as from /metrics. Time is the step's virtual time:
    the busy ratio is forward time over simulated time, in windows of `busy_window`."""

    def __init__(self, metrics: EngineMetrics, prompt_len: Callable[[str], int], block_size: int,
                 busy_window: float = 1.0) -> None:
        self.metrics = metrics
        self.prompt_len = prompt_len
        self.block_size = block_size
        self.busy_window = busy_window
        self._live: dict[str, list] = {}  # id -> [arrival, first_scheduled, first_token, last_token, generated, cached]
        self._window_start: float | None = None
        self._window_forward = 0.0

    def __call__(self, outs: EngineCoreOutputs) -> None:
        m, st, now = self.metrics, outs.stats, outs.timestamp
        if outs.step_time:
            m.record_step(st, outs.step_time, outs.forward_time, st.num_batched_tokens)
        m.set_state(running=st.num_running, waiting=st.num_waiting, swapped=st.num_swapped,
                    used_blocks=st.num_used_blocks, total_blocks=st.num_total_blocks, block_size=self.block_size)
        for out in outs.outputs:
            num_new = len(out.new_token_ids)
            if out.arrival_time is not None:  # first output
                state = self._live[out.request_id] = [out.arrival_time, out.first_scheduled_time, now, now, 0,
                                                      out.num_cached_tokens]
                m.record_first_token(self.prompt_len(out.request_id), out.arrival_time, now)
                m.record_new_tokens(num_new, None)
            else:
                state = self._live.get(out.request_id)
                if state is None:
                    continue
                m.record_new_tokens(num_new, now - state[3])
                state[3] = now
            state[4] += num_new
            if out.finished:
                del self._live[out.request_id]
                arrival, scheduled, first, last, generated, cached = state
                m.record_finished(str(out.finish_reason), self.prompt_len(out.request_id), generated,
                                  RequestMetrics(arrival, scheduled, first, last, now, out.num_preemptions, cached))
        self._busy(now, outs.forward_time)

    def _busy(self, now: float, forward_time: float) -> None:
        if self._window_start is None:
            self._window_start = now - forward_time
        self._window_forward += forward_time
        elapsed = now - self._window_start
        if elapsed >= self.busy_window:
            self.metrics.engine_busy_ratio.set(min(self._window_forward / elapsed, 1.0))
            self._window_start, self._window_forward = now, 0.0


class SimReplay:
    """The simulation, paced at `speed` simulated seconds per wall second (inf: as fast as it
    runs), feeding a dashboard hub. `run_simulation(on_step, gate)` runs the simulation and
    returns its result; `on_done(result)` is called on the replay thread when it ends."""

    def __init__(self, run_simulation: Callable, info, prompt_len: Callable[[str], int], max_model_len: int,
                 speed: float = 1.0, max_snapshot_rate: float = 4.0, on_done: Callable | None = None) -> None:
        if not speed > 0:
            raise ValueError(f"dashboard_speed: must be > 0 simulated seconds per second, got {speed}")
        self.run_simulation = run_simulation
        self.speed = speed
        self.on_done = on_done
        self.metrics = EngineMetrics(info.model, max_model_len, log_interval=0,
                                     max_num_batched_tokens=info.max_num_batched_tokens)
        self.feeder = SimMetricsFeeder(self.metrics, prompt_len, info.block_size)
        self.gate = SnapshotGate(max_rate=max_snapshot_rate)
        # Windows are the server's in wall time, so in simulated time they stretch with the
        # speed: a chart point per half wall second, latency and advisor windows of 30 wall seconds.
        scale = speed if math.isfinite(speed) else 2.0
        self.hub = DashboardHub(info, self.gate,
                                LiveAdvisor(self.metrics.render, window_s=30.0 * scale, sample_every=1.0 * scale),
                                LiveSeries(point_interval=0.5 * scale, window_s=30.0 * scale))
        self.result = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- loop side ------------------------------------------------------------------------
    def _ingest(self, item: EngineCoreOutputs | PoolSnapshot) -> None:
        if isinstance(item, PoolSnapshot):
            self.hub.ingest_snapshot(item)
            return
        self.feeder(item)
        self.hub.ingest(item)

    async def _start_when_watched(self) -> None:
        while not self.hub.clients:
            await asyncio.sleep(0.05)
        self._thread = threading.Thread(target=self._run, name="pagedserve-sim-replay", daemon=True)
        self._thread.start()

    def app(self):
        """A FastAPI app with the dashboard, /metrics (the simulated run's) and /health."""
        from fastapi import FastAPI
        from fastapi.responses import Response

        @asynccontextmanager
        async def lifespan(app):
            self._loop = asyncio.get_running_loop()
            waiter = self._loop.create_task(self._start_when_watched())
            try:
                yield
            finally:
                waiter.cancel()

        app = FastAPI(title="pagedserve simulate --dashboard", lifespan=lifespan)
        add_dashboard_routes(app, self.hub)

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type=CONTENT_TYPE)

        @app.get("/health")
        async def health():
            return Response(status_code=200)

        app.state.replay = self
        app.state.dashboard = self.hub
        return app

    def serve(self, host: str, port: int, log_level: str = "info") -> None:
        """Serve `app()` until a shutdown signal; the signal also ends the pages' event streams
        (uvicorn's graceful shutdown waits for every open response, and a page never closes its own)."""
        import uvicorn

        hub = self.hub

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                hub.close_all_threadsafe()
                super().handle_exit(sig, frame)

        _Server(uvicorn.Config(self.app(), host=host, port=port, log_level=log_level)).run()

    # -- replay thread ------------------------------------------------------------------------
    def _run(self) -> None:
        wall0 = time.monotonic()
        speed = self.speed

        def on_step(outs: EngineCoreOutputs | PoolSnapshot) -> None:
            if math.isfinite(speed) and isinstance(outs, EngineCoreOutputs):  # a snapshot follows its step
                delay = wall0 + outs.timestamp / speed - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            self._loop.call_soon_threadsafe(self._ingest, outs)

        try:
            self.result = self.run_simulation(on_step, self.gate)
            self._loop.call_soon_threadsafe(self.hub.end_of_run)
            if self.on_done is not None:
                self.on_done(self.result)
        except BaseException as e:  # noqa: BLE001 - reported to the CLI; the page stays up
            logger.exception("the simulation failed")
            self.error = e
        finally:
            self.finished.set()


def replay_info(deployment, speed: float):
    cfg = deployment.config
    return DashboardInfo(model=deployment.model_name, num_blocks=deployment.num_blocks, block_size=cfg.block_size,
                         num_host_blocks=deployment.num_host_blocks, source="simulation",
                         speed=speed if math.isfinite(speed) else None,  # None: as fast as it runs
                         max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                         preemption_mode=str(cfg.preemption_mode))


def workload_prompt_len(workload: Sequence) -> Callable[[str], int]:
    """The simulator names request i of the workload str(i)."""
    return lambda request_id: workload[int(request_id)].prompt_len
