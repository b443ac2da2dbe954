"""What happened inside the server during a run, from its Prometheus /metrics.

Scraped once before, sampled every ~0.5 s during, and once after the run. Names are normalised
so pagedserve (`pagedserve:`), vLLM (`vllm:`, including v0's `gpu_cache_usage_perc`) and
llama.cpp (`llamacpp:`, when started with --metrics) all read the same:

    kv_cache_usage_perc, num_requests_running, num_requests_waiting, num_requests_swapped,
    num_preemptions_total, swapped_blocks_total, prefix_cache_queries_total, prefix_cache_hits_total,
    generation_tokens_total, prompt_tokens_total

A server without /metrics (or with none of these) just yields no server section in the report.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("pagedserve:", "vllm:", "llamacpp:")

# Other servers' names for the same quantity (after the prefix is stripped).
ALIASES = {
    "gpu_cache_usage_perc": "kv_cache_usage_perc",      # vLLM v0
    "cpu_cache_usage_perc": "cpu_kv_cache_usage_perc",  # vLLM v0 swap space
    "gpu_prefix_cache_queries_total": "prefix_cache_queries_total",
    "gpu_prefix_cache_hits_total": "prefix_cache_hits_total",
    "kv_cache_usage_ratio": "kv_cache_usage_perc",      # llama.cpp
    "requests_processing": "num_requests_running",      # llama.cpp
    "requests_deferred": "num_requests_waiting",        # llama.cpp
    "tokens_predicted_total": "generation_tokens_total",  # llama.cpp
    "prompt_tokens_total": "prompt_tokens_total",
}

GAUGES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "num_requests_swapped")
COUNTERS = ("num_preemptions_total", "swapped_blocks_total", "prefix_cache_queries_total",
            "prefix_cache_hits_total", "generation_tokens_total", "prompt_tokens_total")
IGNORED_LABELS = ("model_name", "engine")


@dataclass
class Snapshot:
    """One scrape: normalised name -> value summed over labels, and name{label=value} -> value."""

    t: float                                    # seconds since the run started (negative = before)
    totals: dict[str, float] = field(default_factory=dict)
    labelled: dict[str, float] = field(default_factory=dict)

    def get(self, name: str, default: float = 0.0) -> float:
        return self.totals.get(name, default)


def normalise_name(name: str) -> str | None:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            base = name[len(prefix):]
            return ALIASES.get(base, base)
    return None


def parse_metrics(text: str, t: float = 0.0) -> Snapshot:
    """Parse Prometheus text; keeps only samples with a known server prefix."""
    snap = Snapshot(t)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = normalise_name(sample.name)
            if name is None or name.endswith(("_bucket", "_created")):
                continue
            labels = {k: v for k, v in sample.labels.items() if k not in IGNORED_LABELS}
            snap.totals[name] = snap.totals.get(name, 0.0) + sample.value
            if labels:
                key = name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
                snap.labelled[key] = snap.labelled.get(key, 0.0) + sample.value
    return snap


def is_server_metrics(snap: Snapshot | None) -> bool:
    return snap is not None and any(name in snap.totals for name in GAUGES + COUNTERS)


async def scrape(session: aiohttp.ClientSession, url: str, t: float) -> Snapshot | None:
    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                return None
            return parse_metrics(await resp.text(), t)
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
        while True:
            snap = await scrape(self._session, self.url, self._now())
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


def _labelled_delta(before: Snapshot, after: Snapshot, name: str) -> dict[str, float]:
    out = {}
    for key, value in after.labelled.items():
        if key.startswith(name + "{"):
            label = key[len(name) + 1:-1].split("=", 1)[-1]
            out[label] = value - before.labelled.get(key, 0.0)
    return out


def summarize_server_metrics(before: Snapshot | None, after: Snapshot | None,
                             samples: list[Snapshot]) -> dict | None:
    """Peak/mean KV usage and queue lengths, and what the counters grew by during the run."""
    if not is_server_metrics(before) or after is None:
        return None
    during = [s for s in samples if s.t >= 0] or [after]
    out: dict = {}
    for gauge in GAUGES:
        values = [s.totals[gauge] for s in during if gauge in s.totals]
        if values:
            out[f"peak_{gauge}"] = max(values)
            out[f"mean_{gauge}"] = sum(values) / len(values)
    for counter in COUNTERS:
        if counter in after.totals:
            out[counter] = after.totals[counter] - before.get(counter)
    if "num_preemptions_total" in after.totals:
        out["preemptions_by_mode"] = _labelled_delta(before, after, "num_preemptions_total")
    if "swapped_blocks_total" in after.totals:
        out["swapped_blocks_by_direction"] = _labelled_delta(before, after, "swapped_blocks_total")
    queries = out.get("prefix_cache_queries_total")
    if queries:
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits_total", 0.0) / queries
    out["num_samples"] = len(during)
    return out


def timeline(samples: list[Snapshot]) -> dict[str, list[float]]:
    """Per-sample series for plots and the result file: t and every gauge/counter seen."""
    series: dict[str, list[float]] = {"t": [s.t for s in samples]}
    for name in GAUGES + COUNTERS:
        if any(name in s.totals for s in samples):
            series[name] = [s.totals.get(name, float("nan")) for s in samples]
    return series
