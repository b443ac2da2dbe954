"""PNG plots of a run: latency CDFs, a timeline of what the server did, and a sweep's curve."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedserve import metric_names as mn
from pagedserve.bench.client import RequestResult


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_cdfs(results: list[RequestResult], out_dir: Path) -> Path:
    plt = _pyplot()
    ok = [r for r in results if r.success]
    series = {"TTFT": [r.ttft for r in ok], "ITL": [g for r in ok for g in r.itl], "E2E latency": [r.e2el for r in ok]}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (name, values) in zip(axes, series.items()):
        if values:
            ms = np.sort(np.asarray(values) * 1000)
            ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), drawstyle="steps-post")
            for p in (50, 90, 99):
                ax.axvline(np.percentile(ms, p), linestyle=":", color="grey")
        ax.set_title(f"{name} CDF (n={len(values)})")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction ≤ x")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "latency_cdfs.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(results: list[RequestResult], timeline: dict[str, list[float]] | None, duration: float,
                  out_dir: Path, bin_s: float | None = None) -> Path:
    """Output tokens/s (from the client's own chunk times), then the server's gauges if it has /metrics."""
    plt = _pyplot()
    duration = max(duration if duration == duration else 0.0, 1e-3)
    bin_s = bin_s or max(duration / 50, 0.02)
    edges = np.arange(0.0, duration + bin_s, bin_s)
    # Spread each request's output tokens over its content chunks so usage counts stay exact.
    times, weights = [], []
    for r in results:
        chunk_times = r.token_times()
        if chunk_times:
            per_chunk = r.output_tokens / len(chunk_times)
            times += chunk_times
            weights += [per_chunk] * len(chunk_times)
    counts, _ = np.histogram(times, bins=edges, weights=weights) if times else (np.zeros(len(edges) - 1), None)
    in_flight = [sum(1 for r in results if r.e2el > 0 and r.start <= t < r.end) for t in edges[:-1]]

    has_server = bool(timeline) and len(timeline.get("t", [])) > 0
    nrows = 4 if has_server else 2
    fig, axes = plt.subplots(nrows, 1, figsize=(10, 2.6 * nrows), sharex=True)
    # step(where="post") draws a value until the next x, so repeat the last value at the closing edge.
    axes[0].step(edges, np.append(counts, counts[-1]) / bin_s, where="post")
    axes[0].set_ylabel("output tok/s")
    axes[0].set_title("Timeline")
    axes[1].step(edges, in_flight + in_flight[-1:], where="post", label="client: in flight")
    if has_server:
        t = timeline["t"]
        for name, label in ((mn.NUM_REQUESTS_RUNNING, "server: running"), (mn.NUM_REQUESTS_WAITING, "server: waiting"),
                            (mn.NUM_REQUESTS_SWAPPED, "server: swapped")):
            if name in timeline:
                axes[1].plot(t, timeline[name], marker=".", label=label)
        if mn.KV_CACHE_USAGE_PERC in timeline:
            axes[2].plot(t, [100 * v for v in timeline[mn.KV_CACHE_USAGE_PERC]], marker=".")
        axes[2].set_ylabel("KV usage %")
        axes[2].set_ylim(0, 105)
        for counter, label in ((mn.NUM_PREEMPTIONS, "preemptions"), (mn.SWAPPED_BLOCKS, "swapped blocks")):
            key = mn.exposed(counter)
            if key in timeline:
                axes[3].plot(t, [v - timeline[key][0] for v in timeline[key]], label=label)
        axes[3].set_ylabel("cumulative")
        axes[3].legend(loc="upper left")
    axes[1].set_ylabel("requests")
    axes[1].legend(loc="upper right")
    axes[-1].set_xlabel("seconds since start")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "timeline.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(results: list[RequestResult], timeline: dict | None, duration: float, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [plot_cdfs(results, out), plot_timeline(results, timeline, duration, out)]


def plot_sweep(knob: str, points: list[tuple[str, dict]], out_dir: str | Path) -> Path:
    """Output throughput against P99 TTFT and P99 ITL, one marker per point: find the knee."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    thr = [s["output_throughput"] for _, s in points]
    for ax, key, name in ((axes[0], "ttft_ms", "P99 TTFT (ms)"), (axes[1], "itl_ms", "P99 ITL (ms)")):
        lat = [s[key]["p99"] for _, s in points]
        ax.plot(thr, lat, marker="o")
        for (label, _), x, y in zip(points, thr, lat):
            ax.annotate(f"{knob}={label}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Throughput vs tail latency, sweeping {knob}")
    fig.tight_layout()
    path = out / "sweep.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
