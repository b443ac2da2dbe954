"""PNG plots of a simulated run: latency CDFs (TTFT, TPOT, ITL, E2E) and the timeline of
running / waiting / swapped requests with KV usage and preemptions, as `pagedserve bench` draws them."""
from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax, values_ms: list[float], label: str) -> None:
    import numpy as np

    if not values_ms:
        ax.set_title(f"{label}: no data")
        return
    x = np.sort(np.asarray(values_ms))
    y = np.arange(1, len(x) + 1) / len(x)
    ax.plot(x, y)
    for p in (50, 90, 99):
        ax.axvline(np.percentile(x, p), ls=":", lw=0.8, color="gray")
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of requests" if label != "ITL" else "fraction of tokens")
    ax.set_title(f"{label} CDF (p50/p90/p99 dotted)")
    ax.grid(alpha=0.3)


def plot_cdfs(records, out_dir: Path) -> Path:
    plt = _pyplot()
    done = [r for r in records if r.completed]
    itl = [g * 1000 for r in done for g in r.itls()]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    _cdf(axes[0][0], [r.ttft * 1000 for r in done if r.ttft is not None], "TTFT")
    _cdf(axes[0][1], [r.tpot * 1000 for r in done if r.tpot is not None], "TPOT")
    _cdf(axes[1][0], itl, "ITL")
    _cdf(axes[1][1], [r.e2el * 1000 for r in done if r.e2el is not None], "E2E latency")
    fig.tight_layout()
    path = out_dir / "latency_cdf.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(result, out_dir: Path) -> Path:
    plt = _pyplot()
    tl = result.timeline
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    ax1.plot(tl.time, tl.num_running, label="running", lw=0.8)
    ax1.plot(tl.time, tl.num_waiting, label="waiting", lw=0.8)
    ax1.plot(tl.time, tl.num_swapped, label="swapped", lw=0.8)
    ax1.set_ylabel("requests")
    ax1.legend(loc="upper right")
    ax1.grid(alpha=0.3)
    ax2.plot(tl.time, [u * 100 for u in tl.kv_usage], color="tab:purple", lw=0.8)
    ax2.set_ylabel("KV cache usage (%)")
    ax2.set_ylim(0, 105)
    ax2.grid(alpha=0.3)
    pre_t = [t for t, n in zip(tl.time, tl.num_preempted) for _ in range(n)]
    if pre_t:
        ax2.plot(pre_t, [100] * len(pre_t), "rx", ms=4, label=f"preemption ({len(pre_t)})")
        ax2.legend(loc="lower right")
    ax3.plot(tl.time, tl.num_batched_tokens, lw=0.6, color="tab:green")
    ax3.set_ylabel("tokens per step")
    ax3.set_xlabel("time (s, virtual)")
    ax3.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "timeline.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(result, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [plot_cdfs(result.records, out), plot_timeline(result, out)]
