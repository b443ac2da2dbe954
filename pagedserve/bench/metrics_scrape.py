"""What happened inside the server during a run, from its Prometheus /metrics.

Scraped once before, sampled every ~0.5 s during, and once after the run, each scrape parsed by
`bench/prom.py` (so pagedserve, vLLM — V1 or older names — and llama.cpp with --metrics all read
the same). The summary and the timeline key every number by the metric's exposed name without
prefix (`num_preemptions_total`, `kv_cache_usage_perc`), as a PromQL user would type it:

    peak_/mean_ of kv_cache_usage_perc, num_requests_running, num_requests_waiting, num_requests_swapped;
    the run's increase of num_preemptions_total (and per mode), swapped_blocks_total (and per
    direction), prefix_cache_queries_total, prefix_cache_hits_total, generation_tokens_total,
    prompt_tokens_total

A server without /metrics (or with none of these) just yields no server section in the report.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp

from pagedserve import metric_names as mn
from pagedserve.bench.prom import Snapshot, parse_metrics

GAUGES = (mn.KV_CACHE_USAGE_PERC, mn.NUM_REQUESTS_RUNNING, mn.NUM_REQUESTS_WAITING, mn.NUM_REQUESTS_SWAPPED)
COUNTERS = (mn.NUM_PREEMPTIONS, mn.SWAPPED_BLOCKS, mn.PREFIX_CACHE_QUERIES, mn.PREFIX_CACHE_HITS,
            mn.GENERATION_TOKENS, mn.PROMPT_TOKENS)
# Counters also reported per label value: (counter, label, summary key).
BREAKDOWNS = ((mn.NUM_PREEMPTIONS, mn.MODE_LABEL, "preemptions_by_mode"),
              (mn.SWAPPED_BLOCKS, mn.DIRECTION_LABEL, "swapped_blocks_by_direction"))
SAMPLED = GAUGES + COUNTERS  # what summarize_server_metrics and timeline read from mid-run samples


def is_server_metrics(snap: Snapshot | None) -> bool:
    return snap is not None and any(snap.value(name) is not None for name in GAUGES + COUNTERS)


async def scrape(session: aiohttp.ClientSession, url: str, t: float, only=None) -> Snapshot | None:
    """One scrape, parsed (`only`: the canonical names to read, `prom.parse_metrics`)."""
    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                return None
            return parse_metrics(await resp.text(), t, only)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


class MetricsSampler:
    """Scrapes `base_url/metrics` before, every `interval` s during, and after a run."""

    def __init__(self, base_url: str, interval: float = 0.5, api_key: str | None = None) -> None:
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval = interval
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.before: Snapshot | None = None
        self.after: Snapshot | None = None
        self.samples: list[Snapshot] = []
        self._run_start: float | None = None
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None

    def _now(self) -> float:
        return time.perf_counter() - self._run_start if self._run_start is not None else 0.0

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), headers=self.headers,
                                              trust_env=False)
        self.before = await scrape(self._session, self.url, 0.0)

    def mark_run_start(self, run_start: float) -> None:
        """Called with the load's perf_counter start; sampling begins then."""
        self._run_start = run_start
        if is_server_metrics(self.before):
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        # Mid-run samples read only what the summary and the timeline use: this loop also stamps
        # every streamed token's arrival, and parsing the whole scrape (histogram buckets and
        # all) delayed each stream's next token by ~10-14 ms every 0.5 s (a P99 ITL 3.7x the mean
        # on a 1-3-stream workload, benchmarks/README.md). Before / after stay whole.
        while True:
            snap = await scrape(self._session, self.url, self._now(), SAMPLED)
            if snap is not None:
                self.samples.append(snap)
            await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._session is not None:
            if is_server_metrics(self.before):
                self.after = await scrape(self._session, self.url, self._now())
                if self.after is not None:
                    self.samples.append(self.after)
            await self._session.close()


def _label_delta(before: Snapshot, after: Snapshot, name: str, label: str) -> dict[str, float]:
    earlier = before.by_label(name, label)
    return {key: value - earlier.get(key, 0.0) for key, value in after.by_label(name, label).items()}


def summarize_server_metrics(before: Snapshot | None, after: Snapshot | None,
                             samples: list[Snapshot]) -> dict | None:
    """Peak/mean KV usage and queue lengths, and what the counters grew by during the run."""
    if not is_server_metrics(before) or after is None:
        return None
    during = [s for s in samples if s.t >= 0] or [after]
    out: dict = {}
    for gauge in GAUGES:
        values = [v for s in during if (v := s.value(gauge)) is not None]
        if values:
            out[f"peak_{gauge}"] = max(values)
            out[f"mean_{gauge}"] = sum(values) / len(values)
    for counter in COUNTERS:
        if (value := after.value(counter)) is not None:
            out[mn.exposed(counter)] = value - (before.value(counter) or 0.0)
    for counter, label, key in BREAKDOWNS:
        if after.value(counter) is not None:
            out[key] = _label_delta(before, after, counter, label)
    queries = out.get(mn.exposed(mn.PREFIX_CACHE_QUERIES))
    if queries:
        out["prefix_cache_hit_rate"] = out.get(mn.exposed(mn.PREFIX_CACHE_HITS), 0.0) / queries
    out["num_samples"] = len(during)
    return out


def timeline(samples: list[Snapshot]) -> dict[str, list[float]]:
    """Per-sample series for plots and the result file: t and every gauge/counter seen."""
    series: dict[str, list[float]] = {"t": [s.t for s in samples]}
    for name in GAUGES + COUNTERS:
        if any(s.value(name) is not None for s in samples):
            values = [s.value(name) for s in samples]
            series[mn.exposed(name)] = [float("nan") if v is None else v for v in values]
    return series
