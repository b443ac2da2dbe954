"""Prometheus metrics for a serving engine, named as vLLM names them (prefix `pagedserve:`).

vLLM's set (gauges of queue and pool state, token counters, per-request latency and length
histograms) plus what operators ask vLLM for: the pool size and use in tokens, recomputed tokens,
swapped blocks, the step time, and `engine_busy_ratio` — the share of wall time the engine spends
in the model forward (our "utilisation"). Names and help texts come from `metric_names.METRICS`.

Histogram bounds are ours, not vLLM's (docs/metrics.md): a classic histogram's quantile is a
linear interpolation inside the bucket that holds it, so it can be off by up to one bucket width.
Latency bounds therefore follow the preferred numbers over the whole range pagedserve's
latencies take on CPU and GPU: E24 (24 per decade, neighbours 7-15% apart) for the latencies
SLOs are written on (TTFT, ITL, E2E), whose P99 often rests on a density cliff or a handful of
requests, and E12 (12 per decade, 18-25% apart) for queue and step time. Token counts are exact
up to 10 and E24 above (E12 for tokens per step), and preemption counts have a bound at every
integer a request realistically reaches, so `ceil(histogram_quantile(...))` of them is exact.
About 600 bucket series per server and model (vLLM: about 200). vLLM's bounds stay here as
`VLLM_BUCKETS` to compare against (benchmarks).

Every metric lives in the `EngineMetrics`' own CollectorRegistry, so several engines (tests,
benchmarks) can live in one process. prometheus_client is thread-safe: the engine thread
records while the HTTP thread renders. `render()` writes the text from the collectors' values
with each series' line prefix built once (metrics_exposition.py): `generate_latest` took ~5 ms of
CPU per scrape on the API event loop, which held every stream's next token (issue 31).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedserve import metric_names as mn
from pagedserve.metrics_exposition import Exposition, created_series_on, supports

# As vLLM: no `_created` series next to every counter and histogram.
disable_created_metrics()

logger = logging.getLogger("pagedserve.metrics")

PREFIX = mn.PREFIX
CONTENT_TYPE = CONTENT_TYPE_LATEST

# IEC 60063 preferred numbers: E12 neighbours are 18-25% apart, E24 neighbours 7-15% apart.
E12 = (1.0, 1.2, 1.5, 1.8, 2.2, 2.7, 3.3, 3.9, 4.7, 5.6, 6.8, 8.2)
E24 = (1.0, 1.1, 1.2, 1.3, 1.5, 1.6, 1.8, 2.0, 2.2, 2.4, 2.7, 3.0, 3.3, 3.6, 3.9, 4.3, 4.7, 5.1, 5.6, 6.2,
       6.8, 7.5, 8.2, 9.1)


def preferred_ladder(mantissas: Sequence[float], low: float, high: float) -> list[float]:
    """Every mantissa x 10^k within [low, high], ascending (rounded so `le` labels read 0.0012, not 0.00120000001)."""
    if not 0 < low <= high:
        raise ValueError(f"need 0 < low <= high, got {low}, {high}")
    values = {round(m * 10.0 ** e, 12) for e in range(-9, 10) for m in mantissas}
    return sorted(v for v in values if low <= v <= high)


def token_count_buckets(max_value: int, mantissas: Sequence[float] = E24) -> list[int]:
    """1..10 one by one, then the preferred numbers (E24: 7-15% apart) up to `max_value`,
    which is the last bound. Integer counts sit exactly on bounds up to 10; above, a quantile
    reads within one step of the ladder."""
    if max_value < 1:
        raise ValueError(f"max_value must be >= 1, got {max_value}")
    ladder = {int(round(v)) for v in preferred_ladder(mantissas, 10, max_value)}
    return sorted({n for n in range(1, 11) if n <= max_value} | {n for n in ladder if n < max_value} | {max_value})


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass(frozen=True)
class BucketLayout:
    """Histogram bounds for one EngineMetrics: fixed latency ladders, token ladders sized by limits."""
    name: str
    ttft: tuple[float, ...]
    itl: tuple[float, ...]
    e2e: tuple[float, ...]
    queue: tuple[float, ...]
    step: tuple[float, ...]
    preemptions: tuple[float, ...]
    request_tokens: Callable[[int], list[int]]      # max_model_len → bounds
    iteration_tokens: Callable[[int], list[int]]    # max tokens in one step → bounds


PAGEDSERVE_BUCKETS = BucketLayout(
    name="pagedserve",
    # The latencies SLOs are written on (TTFT, ITL, E2E): E24. Their P99 often sits where the density
    # falls off a cliff (the slowest regular steps, the back of a queue) or on a handful of requests;
    # there linear interpolation can miss by up to the bucket's width, and 7-15% keeps that near 10%.
    # TTFT: prefill-bound on an idle GPU (a few ms) to minutes in a queue on a loaded CPU.
    ttft=tuple([0.001, 0.002, 0.003, 0.004] + preferred_ladder(E24, 0.0047, 100.0)
               + [160.0, 320.0, 640.0, 1280.0, 2560.0]),
    # ITL: decode steps take ~2-50 ms on GPU, ~5-100 ms on CPU; a preempted request's gap runs to seconds.
    itl=tuple([0.0002, 0.0005] + preferred_ladder(E24, 0.001, 1.0) + [1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0]),
    e2e=tuple(preferred_ladder(E24, 0.01, 300.0) + [400.0, 600.0, 900.0, 1200.0, 1920.0, 3840.0, 7680.0]),
    # Diagnostics (queue time: mostly ~0, seconds when requests queue; step time): E12, 18-25% apart.
    queue=tuple([0.0001, 0.0005] + preferred_ladder(E12, 0.001, 100.0) + [320.0, 640.0, 1280.0, 2560.0]),
    step=tuple([0.0002, 0.0005] + preferred_ladder(E12, 0.001, 1.0) + [2.5, 5.0, 10.0]),
    preemptions=tuple(float(n) for n in [*range(0, 11), 12, 15, 20, 30, 50, 100]),
    # Lengths: E24, so a fixed benchmark length (every prompt 200 tokens) reads within ~5% at P50.
    request_tokens=token_count_buckets,
    # Decode steps carry one token per running request, prefill steps up to the budget: exact to 10, E12
    # above (vLLM's single 1 -> 8 bucket blurs every decode step of up to 8 requests into one).
    iteration_tokens=lambda limit: token_count_buckets(limit, E12),
)

# vLLM's bounds (v1 PrometheusStatLogger), to compare against; not used by the server.
VLLM_BUCKETS = BucketLayout(
    name="vllm",
    ttft=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
          20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    itl=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
         20.0, 40.0, 80.0),
    e2e=(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
         120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
    queue=(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
    step=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    preemptions=(0, 1, 2, 5, 10, 20, 50, 100),
    request_tokens=build_1_2_5_buckets,
    iteration_tokens=lambda _limit: [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
)
BUCKET_LAYOUTS = {layout.name: layout for layout in (PAGEDSERVE_BUCKETS, VLLM_BUCKETS)}

# `--metric-names`: which prefixes /metrics speaks (docs/metrics.md, "vLLM's names").
#   pagedserve  every metric as pagedserve:*, with our bounds (the default);
#   vllm        every metric vLLM has as vllm:* *with vLLM's bounds*, the rest as pagedserve:*;
#   both        all pagedserve:* (our bounds) and, beside them, vllm:* (vLLM's bounds).
# vllm:* histograms take vLLM's bounds because fleet tooling adds buckets across pods
# (`sum by (le) (rate(vllm:..._bucket[1m]))`): pods with other `le` sets would make each other's
# quantiles wrong, and boards and alerts that name a bound (`le="0.5"`) would find none.
METRIC_NAMINGS = ("pagedserve", "vllm", "both")


class _Fanout:
    """One metric's series under one or two prefixes: every write goes to each of them."""

    def __init__(self, children: list) -> None:
        self.children = children

    def labels(self, *values):
        return _Fanout([c.labels(*values) for c in self.children])

    def clear(self) -> None:
        for c in self.children:
            c.clear()

    def inc(self, amount: float = 1) -> None:
        for c in self.children:
            c.inc(amount)

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)

    def set_function(self, f) -> None:
        for c in self.children:
            c.set_function(f)


class _Registry(CollectorRegistry):
    """A CollectorRegistry that keeps its collectors in registration order (the order `collect()`
    yields them), so render() can write the same families without asking for samples."""

    def __init__(self) -> None:
        super().__init__()
        self.collectors: list = []
        self.generation = 0  # bumped by every register / unregister

    def register(self, collector) -> None:
        super().register(collector)
        self.collectors.append(collector)
        self.generation += 1

    def unregister(self, collector) -> None:
        super().unregister(collector)
        self.collectors.remove(collector)
        self.generation += 1


class EngineMetrics:
    """All server metrics. The engine thread calls the record_* methods; /metrics calls render().

    `max_num_batched_tokens` bounds the tokens-per-step histogram (default: max(max_model_len, 8192));
    `buckets` picks the bounds of the pagedserve:* histograms (`VLLM_BUCKETS` only to compare
    against vLLM's); `names` which prefixes are exposed (METRIC_NAMINGS; vllm:* always with
    vLLM's bounds)."""

    def __init__(self, model_name: str, max_model_len: int, log_interval: float = 10.0,
                 busy_window: float = 1.0, *, max_num_batched_tokens: int | None = None,
                 buckets: BucketLayout = PAGEDSERVE_BUCKETS, names: str = "pagedserve") -> None:
        if names not in METRIC_NAMINGS:
            raise ValueError(f"metric_names: must be one of {METRIC_NAMINGS}, got {names!r}")
        self.registry = _Registry()
        self.model_name = model_name
        self.buckets = buckets
        self.names = names
        step_limit = max_num_batched_tokens or max(max_model_len, 8192)

        def bounds_of(layout: BucketLayout) -> dict:
            return {
                mn.TIME_TO_FIRST_TOKEN: layout.ttft, mn.INTER_TOKEN_LATENCY: layout.itl,
                mn.E2E_REQUEST_LATENCY: layout.e2e, mn.REQUEST_QUEUE_TIME: layout.queue,
                mn.ENGINE_STEP: layout.step, mn.REQUEST_NUM_PREEMPTIONS: layout.preemptions,
                mn.REQUEST_PROMPT_TOKENS: layout.request_tokens(max_model_len),
                mn.REQUEST_GENERATION_TOKENS: layout.request_tokens(max_model_len),
                mn.ITERATION_TOKENS: layout.iteration_tokens(step_limit),
            }

        ours, vllms = bounds_of(buckets), bounds_of(VLLM_BUCKETS)
        # One collector per row of the names table (and per prefix it is exposed under), so
        # nothing is exposed that the table lacks.
        self._collectors = {}
        for spec in mn.METRICS:
            children = []
            if names != "vllm" or spec.vllm is None:
                children.append(self._collector(spec, ours.get(spec.name)))
            if names != "pagedserve" and spec.vllm is not None:
                children.append(self._collector(spec, vllms.get(spec.name), mn.VLLM_PREFIX + spec.vllm))
            self._collectors[spec.name] = children[0] if len(children) == 1 else _Fanout(children)
        # Scheduler and pool state.
        self.num_requests_running = self._unlabelled(mn.NUM_REQUESTS_RUNNING)
        self.num_requests_waiting = self._unlabelled(mn.NUM_REQUESTS_WAITING)
        self.num_requests_swapped = self._unlabelled(mn.NUM_REQUESTS_SWAPPED)
        self.kv_cache_usage_perc = self._unlabelled(mn.KV_CACHE_USAGE_PERC)
        self.kv_cache_total_tokens = self._unlabelled(mn.KV_CACHE_TOTAL_TOKENS)
        self.kv_cache_used_tokens = self._unlabelled(mn.KV_CACHE_USED_TOKENS)
        self.engine_busy_ratio = self._unlabelled(mn.ENGINE_BUSY_RATIO)
        self.kv_cache_bytes_per_token = self._unlabelled(mn.KV_CACHE_BYTES_PER_TOKEN)
        self._cache_config_info = self._collectors[mn.CACHE_CONFIG_INFO]
        # Counters.
        self._preemptions = self._collectors[mn.NUM_PREEMPTIONS]
        self.prompt_tokens = self._unlabelled(mn.PROMPT_TOKENS)
        self.generation_tokens = self._unlabelled(mn.GENERATION_TOKENS)
        self._request_success = self._collectors[mn.REQUEST_SUCCESS]
        self.prefix_cache_queries = self._unlabelled(mn.PREFIX_CACHE_QUERIES)
        self.prefix_cache_hits = self._unlabelled(mn.PREFIX_CACHE_HITS)
        self.recomputed_tokens = self._unlabelled(mn.RECOMPUTED_TOKENS)
        self._swapped_blocks = self._collectors[mn.SWAPPED_BLOCKS]
        self._kv_events = self._collectors[mn.KV_EVENTS]
        self.external_prefix_cache_queries = self._unlabelled(mn.EXTERNAL_PREFIX_CACHE_QUERIES)
        self.external_prefix_cache_hits = self._unlabelled(mn.EXTERNAL_PREFIX_CACHE_HITS)
        self._offload_bytes = self._collectors[mn.KV_OFFLOAD_BYTES]
        self._offload_blocks = self._collectors[mn.KV_OFFLOAD_BLOCKS]
        self.kv_offload_cpu_cache_usage = self._unlabelled(mn.KV_OFFLOAD_CPU_CACHE_USAGE)
        self.prefix_cache_evicted_hits = self._unlabelled(mn.PREFIX_CACHE_EVICTED_HITS)
        self._bytes_per_block = 0  # set_cache_config: one rank's
        self._kv_events_seen = {"published": 0, "dropped": 0}  # the core's cumulative counts so far
        self.engine_stalls = self._unlabelled(mn.ENGINE_STALLS)
        self.engine_stalled = self._unlabelled(mn.ENGINE_STALLED)
        self._stalled = False
        # Histograms.
        self.time_to_first_token = self._unlabelled(mn.TIME_TO_FIRST_TOKEN)
        self.inter_token_latency = self._unlabelled(mn.INTER_TOKEN_LATENCY)
        self.e2e_request_latency = self._unlabelled(mn.E2E_REQUEST_LATENCY)
        self.request_queue_time = self._unlabelled(mn.REQUEST_QUEUE_TIME)
        self.request_prompt_tokens = self._unlabelled(mn.REQUEST_PROMPT_TOKENS)
        self.request_generation_tokens = self._unlabelled(mn.REQUEST_GENERATION_TOKENS)
        self.iteration_tokens = self._unlabelled(mn.ITERATION_TOKENS)
        self.request_num_preemptions = self._unlabelled(mn.REQUEST_NUM_PREEMPTIONS)
        self.engine_step = self._unlabelled(mn.ENGINE_STEP)
        self.structured_output_errors = self._unlabelled(mn.STRUCTURED_OUTPUT_ERRORS)
        self.grammar_cache_entries = self._unlabelled(mn.GRAMMAR_CACHE_ENTRIES)
        self.grammar_cache_bytes = self._unlabelled(mn.GRAMMAR_CACHE_BYTES)

        # Every labelled series exists from the start, so rate() has a zero to start from.
        for mode in ("recompute", "swap"):
            self._preemptions.labels(model_name, mode)
        for reason in ("stop", "length", "abort", "error"):
            self._request_success.labels(model_name, reason)
        for direction in ("out", "in"):
            self._swapped_blocks.labels(model_name, direction)
        for outcome in self._kv_events_seen:
            self._kv_events.labels(model_name, outcome)
        for transfer in ("GPU_to_CPU", "CPU_to_GPU"):
            self._offload_bytes.labels(model_name, transfer)
            self._offload_blocks.labels(model_name, transfer)

        # engine_busy_ratio window, and the periodic log line's interval totals.
        self.busy_window = busy_window
        self._window_start = time.monotonic()
        self._window_forward = 0.0
        self.log_interval = log_interval
        self._log_start = time.monotonic()
        self._log_prompt = 0
        self._log_generation = 0
        self._log_preemptions = 0
        self._log_queries = 0
        self._log_hits = 0
        self._state = dict(running=0, waiting=0, swapped=0, kv_usage=0.0)
        self._exposition: Exposition | None = None
        self._exposition_generation = -1

    def _collector(self, spec: mn.MetricSpec, bounds, name: str | None = None):
        name, labels = name or PREFIX + spec.name, ["model_name", *spec.labels]
        if spec.kind == "gauge":
            return Gauge(name, spec.help, labels, registry=self.registry)
        if spec.kind == "counter":
            return Counter(name, spec.help, labels, registry=self.registry)
        if bounds is None:
            raise ValueError(f"no bucket bounds for histogram {spec.name}")
        return Histogram(name, spec.help, labels, buckets=list(bounds), registry=self.registry)

    def _unlabelled(self, name: str):
        """The model's series of a metric with no label besides model_name."""
        return self._collectors[name].labels(self.model_name)

    # -- engine-level ------------------------------------------------------------------
    def record_step(self, stats, duration: float, forward_time: float, num_batched_tokens: int) -> None:
        for mode, n in stats.num_preempted.items():
            if n:
                self._preemptions.labels(self.model_name, mode).inc(n)
                self._log_preemptions += n
        if stats.num_recomputed_tokens:
            self.recomputed_tokens.inc(stats.num_recomputed_tokens)
        if stats.num_blocks_swapped_out:
            self._swapped_blocks.labels(self.model_name, "out").inc(stats.num_blocks_swapped_out)
        if stats.num_blocks_swapped_in:
            self._swapped_blocks.labels(self.model_name, "in").inc(stats.num_blocks_swapped_in)
        if stats.prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries)
            self.prefix_cache_hits.inc(stats.prefix_cache_hits)
            self._log_queries += stats.prefix_cache_queries
            self._log_hits += stats.prefix_cache_hits
        # Older senders (a replayed trace's stats) may lack the tier's fields.
        evicted = getattr(stats, "prefix_cache_evicted_hits", 0)
        if evicted:
            self.prefix_cache_evicted_hits.inc(evicted)
        if getattr(stats, "tier_total_blocks", 0):
            self._record_tier(stats)
        if num_batched_tokens:
            self.iteration_tokens.observe(num_batched_tokens)
        self.engine_step.observe(duration)
        self._window_forward += forward_time

    def _record_tier(self, stats) -> None:
        if stats.tier_queries:
            self.external_prefix_cache_queries.inc(stats.tier_queries)
            self.external_prefix_cache_hits.inc(stats.tier_hits)
        for transfer, n in (("GPU_to_CPU", stats.num_blocks_offloaded), ("CPU_to_GPU", stats.num_blocks_loaded)):
            if n:
                self._offload_blocks.labels(self.model_name, transfer).inc(n)
                self._offload_bytes.labels(self.model_name, transfer).inc(n * self._bytes_per_block)
        self.kv_offload_cpu_cache_usage.set(stats.tier_used_blocks / stats.tier_total_blocks)

    def set_kv_events(self, published: int, dropped: int) -> None:
        """The engine-core loop's cumulative KV-event counts (they only grow while it lives)."""
        for outcome, total in (("published", published), ("dropped", dropped)):
            if total > self._kv_events_seen[outcome]:
                self._kv_events.labels(self.model_name, outcome).inc(total - self._kv_events_seen[outcome])
                self._kv_events_seen[outcome] = total

    def set_stalled(self, stalled: bool) -> None:
        """The step watchdog's verdict: a new stall counts once; the gauge follows the state."""
        if stalled and not self._stalled:
            self.engine_stalls.inc()
        self._stalled = stalled
        self.engine_stalled.set(1 if stalled else 0)

    def set_cache_config(self, cache_dtype: str, block_size: int, num_blocks: int, bytes_per_token: int,
                         device: str = "unknown") -> None:
        """The KV pool as the engine built it (once, at start-up): its dtype as resolved (fp8 is
        fp8_e4m3, auto the compute dtype) and its device in cache_config_info's labels, and its
        bytes per token."""
        self._cache_config_info.clear()
        self._cache_config_info.labels(self.model_name, cache_dtype, str(block_size), str(num_blocks), device).set(1)
        self.kv_cache_bytes_per_token.set(bytes_per_token)
        self._bytes_per_block = bytes_per_token * block_size

    def set_state(self, running: int, waiting: int, swapped: int, used_blocks: int, total_blocks: int,
                  block_size: int) -> None:
        """Gauges from the live pool and queues (not the last step's snapshot), so they fall to 0 when idle."""
        usage = used_blocks / total_blocks if total_blocks else 0.0
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.num_requests_swapped.set(swapped)
        self.kv_cache_usage_perc.set(usage)
        self.kv_cache_used_tokens.set(used_blocks * block_size)
        self.kv_cache_total_tokens.set(total_blocks * block_size)
        self._state = dict(running=running, waiting=waiting, swapped=swapped, kv_usage=usage)

    def set_engine_state(self, engine: int, running: int, waiting: int, kv_usage: float) -> None:
        """One data-parallel engine core's queues and pool (-dp; `engine` is its rank, vLLM's label)."""
        label = str(engine)
        self._collectors[mn.DP_ENGINE_REQUESTS_RUNNING].labels(self.model_name, label).set(running)
        self._collectors[mn.DP_ENGINE_REQUESTS_WAITING].labels(self.model_name, label).set(waiting)
        self._collectors[mn.DP_ENGINE_KV_CACHE_USAGE_PERC].labels(self.model_name, label).set(kv_usage)

    def tick(self, now: float | None = None) -> None:
        """Close the busy-ratio window and write the periodic log line when their time has come."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._window_start
        if elapsed >= self.busy_window:
            self.engine_busy_ratio.set(min(self._window_forward / elapsed, 1.0))
            self._window_start, self._window_forward = now, 0.0
        if self.log_interval and now - self._log_start >= self.log_interval:
            self._log_line(now)

    def _log_line(self, now: float) -> None:
        elapsed = now - self._log_start
        s = self._state
        active = self._log_prompt or self._log_generation or s["running"] or s["waiting"] or s["swapped"]
        if active:
            hit_rate = self._log_hits / self._log_queries if self._log_queries else 0.0
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Swapped: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%, Preemptions: %d",
                self._log_prompt / elapsed, self._log_generation / elapsed, s["running"], s["swapped"],
                s["waiting"], 100 * s["kv_usage"], 100 * hit_rate, self._log_preemptions)
        self._log_start = now
        self._log_prompt = self._log_generation = self._log_preemptions = 0
        self._log_queries = self._log_hits = 0

    # -- request-level -------------------------------------------------------------------
    def record_first_token(self, num_prompt_tokens: int, arrival: float, first_token: float) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self._log_prompt += num_prompt_tokens
        self.time_to_first_token.observe(max(first_token - arrival, 0.0))

    def record_new_tokens(self, num_new: int, inter_token_gap: float | None) -> None:
        self.generation_tokens.inc(num_new)
        self._log_generation += num_new
        if inter_token_gap is not None:
            # Tokens that arrive together share the gap since the previous one.
            per_token = max(inter_token_gap, 0.0) / num_new
            for _ in range(num_new):
                self.inter_token_latency.observe(per_token)

    def record_finished(self, finish_reason: str, num_prompt_tokens: int, num_generation_tokens: int,
                        metrics) -> None:
        """One finished sequence; `metrics` is its RequestMetrics (None for an abort)."""
        self._request_success.labels(self.model_name, finish_reason).inc()
        if metrics is None:
            return
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        self.request_num_preemptions.observe(metrics.num_preemptions)
        if metrics.finished_time is not None:
            self.e2e_request_latency.observe(max(metrics.finished_time - metrics.arrival_time, 0.0))
        if metrics.first_scheduled_time is not None:
            self.request_queue_time.observe(max(metrics.first_scheduled_time - metrics.arrival_time, 0.0))

    def record_structured_output_error(self) -> None:
        self.structured_output_errors.inc()

    def watch_grammar_cache(self, compiler) -> None:
        """Read the grammar cache's size at each scrape (it changes on the tokenizer thread)."""
        self.grammar_cache_entries.set_function(lambda: compiler.cache_num_entries)
        self.grammar_cache_bytes.set_function(lambda: compiler.cache_num_bytes)

    def render(self) -> bytes:
        """The /metrics text: the same samples as `generate_latest(self.registry)`, for a fraction
        of its CPU (metrics_exposition.py), or generate_latest itself if the registry holds a
        collector the fast path does not know."""
        registry = self.registry
        if self._exposition_generation != registry.generation:
            collectors = registry.collectors
            self._exposition = Exposition(collectors) if all(map(supports, collectors)) else None
            self._exposition_generation = registry.generation
        if self._exposition is None or created_series_on():
            return generate_latest(registry)
        return self._exposition.render()
