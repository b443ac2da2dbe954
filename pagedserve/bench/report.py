"""From per-request timings to the summary `vllm bench serve` prints, plus the server's side.

The project's one latency-report builder: `pagedserve bench` feeds it what the client measured,
`pagedserve simulate` and the in-process replay feed it `RequestRecord`s (converted by
`results_from_records`), so every report computes the same statistics the same way:

* TTFT per request; TPOT per request ((E2E - TTFT) / (output_tokens - 1), requests with more
  than one output token); ITL over every measured gap between token chunks of every request,
  pooled; E2EL per request; only successful requests count.
* `latency_stats`: mean, median, std and P50/P90/P95/P99 in milliseconds, numpy's linear
  interpolation. An empty series gives NaN for every statistic, never 0: "no request finished"
  must not read as "zero latency" (formatted as n/a; NaN fails every SLO comparison).
* Shape: `summarize` nests them (`summary["itl_ms"]["p99"]`); `vllm_flat_keys` spells the same
  numbers in vLLM's --save-result naming (`p99_itl_ms`) for result files (simulate, tune).

Imports run one way: `sim` may use this module, this module never imports `sim`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from pagedserve import metric_names as mn
from pagedserve.bench.client import RequestResult

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
LATENCY_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """One request as the simulator or an in-process replay timed it (seconds on the run's clock)."""
    request_id: str
    arrival: float                       # when the request was sent (s)
    prompt_len: int
    output_len: int                      # tokens asked for
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    finish: float | None = None
    num_preemptions: int = 0
    failed: bool = False                 # rejected (e.g. longer than max_model_len)
    error: str = ""

    @property
    def completed(self) -> bool:
        return not self.failed and self.finish is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def e2el(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def tpot(self) -> float | None:
        n = self.num_output_tokens
        if n < 2 or self.finish is None or self.first_token_time is None:
            return None
        return (self.finish - self.first_token_time) / (n - 1)

    def itls(self) -> list[float]:
        t = self.token_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            key, sep, value = part.partition(":")
            if not sep or key not in GOODPUT_KEYS:
                raise ValueError(f"goodput: expected KEY:MS with KEY in {GOODPUT_KEYS}, got {part!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"goodput: {key} must be a number of milliseconds, got {value!r}") from None
            if not ms > 0:
                raise ValueError(f"goodput: {key} must be > 0 ms, got {value!r}")
            slos[key] = ms
    return slos


def latency_stats(values_s: list[float]) -> dict[str, float]:
    """mean / median / std / p50 / p90 / p95 / p99 in milliseconds; NaN for all when `values_s` is empty."""
    if not values_s:
        nan = math.nan
        return {"mean": nan, "median": nan, "std": nan, **{f"p{p}": nan for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    out = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(ms, p))
    return out


def latency_series(results: list[RequestResult]) -> dict[str, list[float]]:
    """The seconds each statistic is taken over, from the successful requests."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }


def vllm_flat_keys(summary: dict) -> dict[str, float]:
    """summary["itl_ms"]["p99"] → {"p99_itl_ms": ...}: the same numbers as vLLM's result JSON names them."""
    out = {}
    for name in LATENCIES:
        for stat, value in summary[f"{name}_ms"].items():
            out[f"{stat}_{name}_ms"] = value
    return out


def results_from_records(records: list[RequestRecord]) -> list[RequestResult]:
    """The client's view of requests the simulator (or an in-process replay) timed, so one
    report serves both: `pagedserve simulate` prints exactly what `pagedserve bench` prints."""
    out = []
    for i, r in enumerate(records):
        out.append(RequestResult(
            index=i, success=r.completed, error=r.error, prompt_len=r.prompt_len,
            output_tokens=r.num_output_tokens, output_tokens_from_usage=True, num_chunks=r.num_output_tokens,
            start=r.arrival, ttft=r.ttft or 0.0, itl=r.itls(), e2el=r.e2el or 0.0, scheduled=r.arrival))
    return out


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at once, from their [start, end] intervals."""
    events = []
    for r in results:
        if r.e2el > 0:
            events.append((r.start, 1))
            events.append((r.end, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    if not r.success:
        return False
    if "ttft" in slos and r.ttft * 1000 > slos["ttft"]:
        return False
    if "tpot" in slos and (r.tpot or 0.0) * 1000 > slos["tpot"]:
        return False
    if "e2el" in slos and r.e2el * 1000 > slos["e2el"]:
        return False
    return True


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float] | None = None,
              server: dict | None = None) -> dict:
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    dur = duration if duration and duration > 0 else math.nan
    summary: dict = {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "output_tokens_from_usage": all(r.output_tokens_from_usage for r in ok) if ok else False,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
        "peak_concurrency": peak_concurrency(results),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in results)
        summary["goodput_slos_ms"] = dict(slos)
        summary["good_requests"] = good
        summary["request_goodput"] = good / dur
    series = latency_series(results)
    for name in LATENCIES:
        summary[f"{name}_ms"] = latency_stats(series[name])
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            key = r.error[:120] or "unknown"
            errors[key] = errors.get(key, 0) + 1
    if errors:
        summary["errors"] = errors
    if server is not None:
        summary["server"] = server
    return summary


def _fmt(value, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def format_summary(summary: dict, title: str = "Serving Benchmark Result") -> str:
    width = 60
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(label: str, value, spec: str = ".2f") -> None:
        lines.append(f"{label:<44}{_fmt(value, spec):>16}")

    row("Successful requests:", summary["successful_requests"], "d")
    row("Failed requests:", summary["failed_requests"], "d")
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"], "d")
    row("Total generated tokens:", summary["total_output_tokens"], "d")
    row("Request throughput (req/s):", summary["request_throughput"])
    if "request_goodput" in summary:
        slos = " ".join(f"{k}:{v:g}" for k, v in summary["goodput_slos_ms"].items())
        row(f"Request goodput (req/s) [{slos}]:", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    row("Peak concurrent requests:", summary["peak_concurrency"], "d")
    for name in LATENCIES:
        stats = summary[f"{name}_ms"]
        lines.append(f"{' ' + LATENCY_NAMES[name] + ' ':-^{width}}")
        upper = name.upper()
        row(f"Mean {upper} (ms):", stats["mean"])
        row(f"Median {upper} (ms):", stats["median"])
        for p in PERCENTILES[1:]:
            row(f"P{p} {upper} (ms):", stats[f"p{p}"])
    server = summary.get("server")
    if server:
        lines.append(f"{' Inside the server (/metrics) ':-^{width}}")
        if f"peak_{mn.KV_CACHE_USAGE_PERC}" in server:
            row("Peak KV-cache usage (%):", 100 * server[f"peak_{mn.KV_CACHE_USAGE_PERC}"], ".1f")
            row("Mean KV-cache usage (%):", 100 * server[f"mean_{mn.KV_CACHE_USAGE_PERC}"], ".1f")
        for gauge, label in ((mn.NUM_REQUESTS_RUNNING, "running"), (mn.NUM_REQUESTS_WAITING, "waiting"),
                             (mn.NUM_REQUESTS_SWAPPED, "swapped")):
            if f"peak_{gauge}" in server:
                row(f"Peak / mean {label} requests:",
                    f"{server[f'peak_{gauge}']:.0f} / {server[f'mean_{gauge}']:.1f}", "")
        for counter, label, breakdown in ((mn.NUM_PREEMPTIONS, "Preemptions", "preemptions_by_mode"),
                                          (mn.SWAPPED_BLOCKS, "Swapped blocks", "swapped_blocks_by_direction")):
            if mn.exposed(counter) in server:
                parts = server.get(breakdown) or {}
                detail = " (" + ", ".join(f"{k} {v:.0f}" for k, v in sorted(parts.items())) + ")" if parts else ""
                row(f"{label}{detail}:", server[mn.exposed(counter)], ".0f")
        if mn.exposed(mn.PREFIX_CACHE_QUERIES) in server:
            rate = server.get("prefix_cache_hit_rate")
            row("Prefix-cache hit rate (%):", None if rate is None else 100 * rate, ".1f")
        row("Metric samples during the run:", server.get("num_samples", 0), "d")
    if summary.get("errors"):
        lines.append(f"{' Errors ':-^{width}}")
        for err, n in sorted(summary["errors"].items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"{n:>5} x {err}")
    lines.append("=" * width)
    return "\n".join(lines)


SWEEP_COLUMNS = (("point", "{}"), ("ok/fail", "{}"), ("req/s", "{:.2f}"), ("out tok/s", "{:.1f}"),
                 ("P99 TTFT ms", "{:.1f}"), ("P99 ITL ms", "{:.1f}"), ("peak conc", "{}"), ("preempt", "{}"))


def sweep_row(label: str, summary: dict) -> list[str]:
    server = summary.get("server") or {}
    pre = server.get(mn.exposed(mn.NUM_PREEMPTIONS))
    return [label, f"{summary['successful_requests']}/{summary['failed_requests']}",
            _fmt(summary["request_throughput"]), _fmt(summary["output_throughput"], ".1f"),
            _fmt(summary["ttft_ms"]["p99"], ".1f"), _fmt(summary["itl_ms"]["p99"], ".1f"),
            str(summary["peak_concurrency"]), "n/a" if pre is None else f"{pre:.0f}"]


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def format_sweep(knob: str, points: list[tuple[str, dict]]) -> str:
    header = [knob if name == "point" else name for name, _ in SWEEP_COLUMNS]
    return format_table(header, [sweep_row(label, s) for label, s in points])
