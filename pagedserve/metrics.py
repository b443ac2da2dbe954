"""Prometheus metrics for a serving engine, named as vLLM names them (prefix `pagedserve:`).

vLLM's set (gauges of queue and pool state, token counters, per-request latency histograms
with vLLM's buckets) plus what operators ask vLLM for: the pool size and use in tokens,
recomputed tokens, swapped blocks, the step time, and `engine_busy_ratio` — the share of
wall time the engine spends in the model forward (our "utilisation").

Every metric lives in the `EngineMetrics`' own CollectorRegistry, so several engines (tests,
benchmarks) can live in one process. prometheus_client is thread-safe: the engine thread
records while the HTTP thread renders.
"""
from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# As vLLM: no `_created` series next to every counter and histogram.
disable_created_metrics()

logger = logging.getLogger("pagedserve.metrics")

PREFIX = "pagedserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets (v1 PrometheusStatLogger).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PREEMPTION_BUCKETS = [0, 1, 2, 5, 10, 20, 50, 100]
# Ours: engine steps on CPU take milliseconds to seconds.
STEP_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


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


class EngineMetrics:
    """All server metrics. The engine thread calls the record_* methods; /metrics calls render()."""

    def __init__(self, model_name: str, max_model_len: int, log_interval: float = 10.0,
                 busy_window: float = 1.0) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str, extra: list[str] | None = None):
            c = Counter(PREFIX + name, doc, labels + (extra or []), registry=reg)
            return c if extra else c.labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        # Scheduler and pool state.
        self.num_requests_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Number of requests swapped out to host memory.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.kv_cache_total_tokens = gauge("kv_cache_total_tokens", "Tokens the KV-cache pool holds (blocks x block_size).")
        self.kv_cache_used_tokens = gauge("kv_cache_used_tokens", "Token slots in blocks held by requests.")
        self.engine_busy_ratio = gauge("engine_busy_ratio",
                                       "Share of wall time spent in the model forward over the last window.")
        # Counters.
        self._preemptions = counter("num_preemptions", "Cumulative number of preemptions.", ["mode"])
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._request_success = counter("request_success", "Count of finished requests by finish reason.",
                                        ["finished_reason"])
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.recomputed_tokens = counter("recomputed_tokens", "Tokens whose KV was dropped by recompute preemption.")
        self._swapped_blocks = counter("swapped_blocks", "KV blocks moved between device and host.", ["direction"])
        # Histograms.
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Histogram of end to end request latency in seconds.",
                                             REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Histogram of time spent waiting before first scheduled.",
                                            REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens per request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens per request.", token_buckets)
        self.iteration_tokens = histogram("iteration_tokens_total", "Histogram of tokens per engine step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.request_num_preemptions = histogram("request_num_preemptions",
                                                 "Number of times a finished request was preempted.",
                                                 PREEMPTION_BUCKETS)
        self.engine_step = histogram("engine_step_seconds", "Histogram of engine step duration in seconds.",
                                     STEP_BUCKETS)

        for mode in ("recompute", "swap"):
            self._preemptions.labels(model_name, mode)
        for reason in ("stop", "length", "abort"):
            self._request_success.labels(model_name, reason)
        for direction in ("out", "in"):
            self._swapped_blocks.labels(model_name, direction)

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
        if num_batched_tokens:
            self.iteration_tokens.observe(num_batched_tokens)
        self.engine_step.observe(duration)
        self._window_forward += forward_time

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

    def render(self) -> bytes:
        return generate_latest(self.registry)
