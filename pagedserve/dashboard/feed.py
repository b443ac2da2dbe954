"""What the dashboard shows, computed on the front-end's event loop from the engine's steps.

The engine thread hands every step's `EngineCoreOutputs` to the loop (engine/async_llm.py;
in `simulate --dashboard` the replay thread does); `DashboardHub.ingest` folds it into:

- time-series points, one per `point_interval` seconds of the engine's clock (virtual in a
  simulation): KV usage, running / waiting / swapped, preemptions per second by mode, prefix
  hit rate, prefill and decode tokens per step, busy ratio (forward time over elapsed time,
  as `engine_busy_ratio`), and TTFT / ITL P50 and P99 over a sliding window of raw samples
  (TTFT = first token's step end - arrival, ITL = gap between a request's token steps shared
  by the tokens that arrived together: the definitions /metrics' histograms use);
- the latest pool snapshot (core/snapshot.py), when the engine thread attached one;
- the advisor's verdict: `pagedserve advise`'s own verdict (advise/advisor.py `judge`, the
  device read from the metrics as `advise` reads it) over the same Prometheus text a scraper
  of /metrics would read, sampled once a second of engine time over a sliding window, and
  only while someone looks (a page connected, or /dashboard/state read within the window): a
  sample renders and parses the whole text, which nobody should pay for unwatched.

Everything here runs on the loop thread only; nothing reads the engine core.
"""
from __future__ import annotations

import asyncio
import collections
import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pagedserve.advise.advisor import Thresholds, detect_device, judge
from pagedserve.bench.prom import parse_metrics
from pagedserve.core.outputs import EngineCoreOutputs
from pagedserve.core.snapshot import PoolSnapshot, SnapshotGate

PREEMPTION_MODES = ("recompute", "swap")
_STALE_REQUEST_S = 300.0   # a request silent this long (aborted) leaves the ITL bookkeeping
_MAX_PENDING_FRAMES = 32   # a client this far behind gets one full state instead


@dataclass
class _Accumulator:
    """One point in the making."""

    start: float
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    forward_time: float = 0.0
    preempted: dict[str, int] = field(default_factory=lambda: {m: 0 for m in PREEMPTION_MODES})
    prefix_queries: int = 0
    prefix_hits: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


def _quantiles(chunks: list[np.ndarray]) -> tuple[float | None, float | None]:
    values = np.concatenate(chunks) if chunks else np.empty(0)
    if not values.size:
        return None, None
    p50, p99 = np.percentile(values, [50, 99])
    return float(p50), float(p99)


class LiveSeries:
    """Steps in, points out. `window_s`: the latency percentiles' sliding window (engine seconds)."""

    def __init__(self, point_interval: float = 0.5, window_s: float = 30.0, max_points: int = 1200) -> None:
        if not point_interval > 0:
            raise ValueError(f"point_interval: must be > 0 seconds, got {point_interval}")
        self.point_interval = point_interval
        self.window_s = window_s
        self.points: collections.deque[dict] = collections.deque(maxlen=max_points)
        self.total_preemptions = {m: 0 for m in PREEMPTION_MODES}
        self.total_steps = 0
        self._acc: _Accumulator | None = None
        self._last_outs: EngineCoreOutputs | None = None
        self._window: collections.deque[tuple[float, np.ndarray, np.ndarray]] = collections.deque()
        self._last_token: dict[str, float] = {}
        self._last_sweep = 0.0

    def ingest(self, outs: EngineCoreOutputs) -> dict | None:
        """Fold one step (or an idle state report) in; returns the point it closed, if any."""
        now = outs.timestamp
        acc = self._acc
        if acc is None:
            acc = self._acc = _Accumulator(start=now)
        st = outs.stats
        if outs.step_time:  # a real step (idle reports carry state only)
            acc.steps += 1
            self.total_steps += 1
            acc.prefill_tokens += st.num_prefill_tokens
            acc.decode_tokens += st.num_decode_tokens
            acc.forward_time += outs.forward_time
            for mode, n in st.num_preempted.items():
                acc.preempted[mode] = acc.preempted.get(mode, 0) + n
                self.total_preemptions[mode] = self.total_preemptions.get(mode, 0) + n
            acc.prefix_queries += st.prefix_cache_queries
            acc.prefix_hits += st.prefix_cache_hits
        self._latency(outs, acc)
        self._last_outs = outs
        if now - acc.start < self.point_interval:
            return None
        return self.close_point()

    def close_point(self) -> dict | None:
        """Close the point in the making now (a run's end), if it has seen anything."""
        acc, outs = self._acc, self._last_outs
        if acc is None or outs is None:
            return None
        point = self._close(acc, outs)
        self._acc = _Accumulator(start=outs.timestamp)
        self._last_outs = None
        return point

    def _latency(self, outs: EngineCoreOutputs, acc: _Accumulator) -> None:
        now = outs.timestamp
        last = self._last_token
        for out in outs.outputs:
            num_new = len(out.new_token_ids)
            if num_new:
                if out.arrival_time is not None:  # the request's first output
                    acc.ttft.append(max(now - out.arrival_time, 0.0))
                elif out.request_id in last:
                    gap = max(now - last[out.request_id], 0.0) / num_new
                    acc.itl.extend([gap] * num_new)
                last[out.request_id] = now
            if out.finished:
                last.pop(out.request_id, None)

    def _close(self, acc: _Accumulator, outs: EngineCoreOutputs) -> dict:
        now = outs.timestamp
        st = outs.stats
        elapsed = max(now - acc.start, 1e-9)
        window = self._window  # a point's samples are kept as arrays: the percentiles cost O(window) in numpy
        window.append((now, np.asarray(acc.ttft, dtype=np.float64), np.asarray(acc.itl, dtype=np.float64)))
        while window and window[0][0] < now - self.window_s:
            window.popleft()
        ttft50, ttft99 = _quantiles([w[1] for w in window])
        itl50, itl99 = _quantiles([w[2] for w in window])
        if now - self._last_sweep > _STALE_REQUEST_S:
            self._last_sweep = now
            self._last_token = {rid: t for rid, t in self._last_token.items() if t >= now - _STALE_REQUEST_S}
        point = {
            "t": now,
            "kv": st.kv_usage, "used": st.num_used_blocks,
            "running": st.num_running, "waiting": st.num_waiting, "swapped": st.num_swapped,
            "steps": acc.steps,
            "prefill_per_step": acc.prefill_tokens / acc.steps if acc.steps else 0.0,
            "decode_per_step": acc.decode_tokens / acc.steps if acc.steps else 0.0,
            "busy": min(acc.forward_time / elapsed, 1.0),
            "hit_rate": acc.prefix_hits / acc.prefix_queries if acc.prefix_queries else None,
            "ttft_p50": ttft50, "ttft_p99": ttft99, "itl_p50": itl50, "itl_p99": itl99,
        }
        for mode in PREEMPTION_MODES:
            point[f"preempt_{mode}"] = acc.preempted.get(mode, 0) / elapsed
            point[f"preempted_{mode}"] = acc.preempted.get(mode, 0)
        self.points.append(point)
        return point


_COLLECTING = {"verdict": "collecting", "summary": "waiting for a second sample of the metrics",
               "findings": [], "notes": []}


class LiveAdvisor:
    """`pagedserve advise` on the live numbers: the Prometheus text `metrics_text()` returns
    (what /metrics serves) is sampled every `sample_every` engine seconds into a window of
    `window_s`, and the advisor's `judge` (what `pagedserve advise` calls) gives that window's verdict."""

    def __init__(self, metrics_text: Callable[[], bytes | str], window_s: float = 30.0, sample_every: float = 1.0,
                 thresholds=None) -> None:
        self.metrics_text = metrics_text
        self.window_s = window_s
        self.sample_every = sample_every
        self.thresholds = thresholds if thresholds is not None else Thresholds()
        self.samples: collections.deque = collections.deque()
        self.device = "unknown"  # read from the metrics, as `pagedserve advise --device auto` does
        self.verdict: dict = dict(_COLLECTING)
        self._next = -math.inf

    def restart(self) -> None:
        """Forget the samples (nobody looked for a while: a window across the gap would judge
        minutes nobody watched as one interval)."""
        self.samples.clear()
        self.verdict = dict(_COLLECTING)
        self._next = -math.inf

    def update(self, now: float) -> bool:
        """Sample and judge when due; True if the verdict was recomputed."""
        if now < self._next:
            return False
        self._next = now + self.sample_every
        text = self.metrics_text()
        text = text.decode() if isinstance(text, bytes) else text
        if self.device == "unknown":
            self.device = detect_device([text])
        self.samples.append((now, parse_metrics(text)))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.window_s:
            self.samples.popleft()
        if len(self.samples) < 2:
            return False
        t0, t1 = self.samples[0][0], self.samples[-1][0]
        report = judge([s for _, s in self.samples], max(t1 - t0, 1e-9), self.thresholds, device=self.device)
        self.verdict = _verdict_dict(report, t1 - t0)
        return True


def _verdict_dict(report, interval_s: float) -> dict:
    fields = ("rule", "title", "symptom", "cause", "knob", "direction", "action", "watch")
    return {"verdict": report.verdict, "summary": report.summary, "interval_s": interval_s,
            "findings": [{name: getattr(f, name, None) for name in fields} for f in report.findings],
            "notes": list(report.notes)}


class _Client:
    def __init__(self) -> None:
        self.pending: list[str] = []
        self.event = asyncio.Event()
        self.closed = False  # the server is going down: end the stream


@dataclass
class DashboardInfo:
    """Static facts the page shows and sizes itself by."""

    model: str
    num_blocks: int
    block_size: int
    num_host_blocks: int
    source: str = "server"            # server | simulation
    speed: float | None = None        # simulation: virtual seconds per wall second; None = unpaced
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    preemption_mode: str | None = None


class DashboardHub:
    """Ingests steps (loop thread), keeps the state, fans frames out to connected pages.

    A frame goes out when a pool snapshot arrives, or a second after points were closed
    without one. Frames carry only the new points; a page that connects gets the history."""

    def __init__(self, info: DashboardInfo, gate: SnapshotGate, advisor: LiveAdvisor | None,
                 series: LiveSeries | None = None, flush_every: float = 1.0) -> None:
        self.info = info
        self.gate = gate
        self.advisor = advisor
        self.series = series or LiveSeries()
        self.flush_every = flush_every
        self.snapshot: dict | None = None
        self.clients: set[_Client] = set()
        self.num_frames = 0
        self._new_points: list[dict] = []
        self._verdict_changed = False
        self._last_flush = time.monotonic()
        self._viewed_until = -math.inf   # the advisor samples only while someone looks (_watched)
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- engine side (loop thread) ------------------------------------------------------
    def ingest(self, outs: EngineCoreOutputs) -> None:
        point = self.series.ingest(outs)
        if point is not None:
            self._new_points.append(point)
        # The verdict renders and parses the whole /metrics text (tens of ms a second of the API
        # process's CPU, which on a small CPU box the engine's threads pay for): only while someone
        # looks, a page connected or /dashboard/state read within the advisor's window.
        if self.advisor is not None and self._watched() and self.advisor.update(outs.timestamp):
            self._verdict_changed = True
        if not self.clients:
            self._new_points.clear()
            return
        if time.monotonic() - self._last_flush >= self.flush_every and (self._new_points or self._verdict_changed):
            self._flush(False)

    def _watched(self) -> bool:
        return bool(self.clients) or time.monotonic() < self._viewed_until

    def _viewer_arrives(self) -> None:
        """Someone looks again after nobody did: the advisor starts a fresh window."""
        if self.advisor is not None and not self._watched():
            self.advisor.restart()
        self._viewed_until = time.monotonic() + (self.advisor.window_s if self.advisor is not None else 0.0)

    def ingest_snapshot(self, snapshot: PoolSnapshot) -> None:
        """The pool after the step ingested last: it goes out now, with the points so far."""
        self.snapshot = snapshot.to_dict()
        if self.clients:
            self._flush(True)

    def end_of_run(self) -> None:
        """No more steps will come (a replay ended): show the last partial point now."""
        point = self.series.close_point()
        if point is not None:
            self._new_points.append(point)
        if self.clients:
            self._flush(self.snapshot is not None)

    def _flush(self, with_snapshot: bool) -> None:
        frame = {"type": "frame", "points": self._new_points, "totals": self.totals()}
        if with_snapshot:
            frame["snapshot"] = self.snapshot
        if self._verdict_changed and self.advisor is not None:
            frame["verdict"] = self.advisor.verdict
        self._broadcast(json.dumps(frame, allow_nan=False))
        self._new_points = []
        self._verdict_changed = False
        self._last_flush = time.monotonic()
        self.num_frames += 1

    def totals(self) -> dict:
        return {"preemptions": dict(self.series.total_preemptions), "steps": self.series.total_steps}

    # -- pages ----------------------------------------------------------------------------
    def state(self) -> dict:
        """Everything a page needs to draw from scratch."""
        self._viewer_arrives()
        return {"type": "init", "info": self.info.__dict__ | {"point_interval": self.series.point_interval,
                                                             "window_s": self.series.window_s,
                                                             "max_snapshot_rate": self.gate.max_rate},
                "points": list(self.series.points), "snapshot": self.snapshot, "totals": self.totals(),
                "verdict": self.advisor.verdict if self.advisor is not None else None}

    def connect(self) -> _Client:
        self._loop = asyncio.get_running_loop()
        client = _Client()
        client.pending.append(json.dumps(self.state(), allow_nan=False))
        client.event.set()
        self.clients.add(client)
        self.gate.add_watcher()
        return client

    def disconnect(self, client: _Client) -> None:
        if client in self.clients:
            self.clients.discard(client)
            self.gate.remove_watcher()

    def close_all(self) -> None:
        """End every page's stream (the page's EventSource reconnects to a server that is back)."""
        for client in self.clients:
            client.closed = True
            client.event.set()

    def close_all_threadsafe(self) -> None:
        """close_all from any thread or a signal handler."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.close_all)

    def _broadcast(self, message: str) -> None:
        for client in self.clients:
            if len(client.pending) >= _MAX_PENDING_FRAMES:  # a slow page: resynchronise it
                client.pending = [json.dumps(self.state(), allow_nan=False)]
            else:
                client.pending.append(message)
            client.event.set()
