"""`pagedserve advise`: scrape a live server's /metrics over an interval (or read two saved scrapes)
and print what the source articles' symptom → cause → knob table says to change first."""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from urllib.parse import urlsplit, urlunsplit

from pagedserve.advise.advisor import Thresholds, detect_device, format_report, judge
from pagedserve.bench.prom import Snapshot, fetch_text, parse_metrics

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, None: 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
SLO_KEYS = {"ttft_p99": "ttft_p99_ms", "itl_p99": "itl_p99_ms"}


def parse_duration(text: str) -> float:
    """'30s', '1m', '500ms', '2' (seconds) → seconds."""
    match = _DURATION.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a positive duration: {text!r} (use e.g. 30s, 1m, 500ms)")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def parse_slo(items: list[str]) -> dict[str, float]:
    """['ttft_p99:2000', 'itl_p99:80'] → {'ttft_p99_ms': 2000.0, 'itl_p99_ms': 80.0}."""
    out = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"--slo takes NAME:MS with NAME in {sorted(SLO_KEYS)}, got {item!r}")
        try:
            ms = float(value.removesuffix("ms"))
        except ValueError:
            raise ValueError(f"--slo {item!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"--slo {item!r}: the SLO must be > 0 ms")
        out[SLO_KEYS[key]] = ms
    return out


def metrics_url(url: str) -> str:
    """A bare host:port gets /metrics appended."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urlunsplit(parts)


def thresholds_from_args(args) -> Thresholds:
    t = Thresholds(kv_high=args.kv_high, kv_low=args.kv_low, kv_pinned_share=args.kv_pinned_share,
                   util_low=args.util_low, util_high=args.util_high,
                   preemptions_per_min=args.preemptions_per_min, long_prompt_tokens=args.long_prompt_tokens,
                   queue_share=args.queue_share, queue_ttft_share=args.queue_ttft_share,
                   short_prompt_tokens=args.short_prompt_tokens,
                   gpu_memory_utilization_margin=args.gpu_memory_utilization_margin,
                   evicted_prefix_share=args.evicted_prefix_share)
    for name, value in parse_slo(args.slo or []).items():
        setattr(t, name, value)
    for name in ("kv_high", "kv_low", "kv_pinned_share", "util_low", "util_high", "queue_share", "queue_ttft_share",
                 "gpu_memory_utilization_margin", "evicted_prefix_share"):
        value = getattr(t, name)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be within [0, 1], got {value}")
    if t.kv_low > t.kv_high:
        raise ValueError(f"--kv-low ({t.kv_low}) must not exceed --kv-high ({t.kv_high})")
    if t.preemptions_per_min < 0 or t.long_prompt_tokens <= 0:
        raise ValueError("--preemptions-per-min must be ≥ 0 and --long-prompt-tokens > 0")
    return t


def scrape_interval(url: str, interval_s: float, sample_every_s: float, timeout: float,
                    clock=time.monotonic, sleep=time.sleep,
                    first_text: list[str] | None = None) -> tuple[list[Snapshot], float]:
    """Scrape at the start, every `sample_every_s`, and at the end; return the snapshots and the
    measured time between the first and the last (`first_text` gets the first scrape's text)."""
    start = clock()
    text = fetch_text(url, timeout)
    if first_text is not None:
        first_text.append(text)
    snapshots = [parse_metrics(text)]
    first_done = clock()
    k = 1
    while True:
        due = min(first_done + k * sample_every_s, first_done + interval_s)
        sleep(max(0.0, due - clock()))
        snapshots.append(parse_metrics(fetch_text(url, timeout)))
        if due >= first_done + interval_s:
            break
        k += 1
    return snapshots, max(clock() - start, 1e-9)


def run(args) -> int:
    # A report is for people: one httpx INFO line per scrape is noise in it.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    thresholds = thresholds_from_args(args)
    gpu_util = None
    if args.gpu_util is not None:
        if not 0.0 <= args.gpu_util <= 100.0:
            raise ValueError(f"--gpu-util is a percentage in [0, 100], got {args.gpu_util}")
        gpu_util = args.gpu_util / 100.0
    if args.from_files:
        texts = []
        for path in args.from_files:
            try:
                with open(path, encoding="utf-8") as f:
                    texts.append(f.read())
            except OSError as e:
                raise ValueError(f"cannot read {path}: {e.strerror}") from None
        snapshots = [parse_metrics(text) for text in texts]
        device = args.device if args.device != "auto" else detect_device(texts)
        interval_s, sampled = args.interval, False
        source = f"{args.from_files[0]} → {args.from_files[1]} (interval taken from --interval)"
    else:
        sample_every = min(args.sample_every, args.interval)
        url = metrics_url(args.metrics_url)
        if not args.json:
            print(f"scraping {url} for {args.interval:.1f} s (a sample every {sample_every:.1f} s)...",
                  file=sys.stderr)
        first_text: list[str] = []
        snapshots, interval_s = scrape_interval(url, args.interval, sample_every, args.timeout,
                                                first_text=first_text)
        device = args.device if args.device != "auto" else detect_device(first_text)
        sampled = True
        source = url
    if not any(s.counters or s.gauges or s.histograms for s in snapshots):
        raise ValueError(f"no metrics found in {source}")
    report = judge(snapshots, interval_s, thresholds, device=device, gpu_util=gpu_util, gauges_sampled=sampled)
    if args.json:
        print(json.dumps(dict(source=source, **report.to_dict()), indent=2))
    else:
        print(format_report(report, source))
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    d = Thresholds()
    p = subparsers.add_parser(
        "advise", help="read a server's metrics over an interval and say which knob to move first",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--metrics-url", help="a live Prometheus endpoint (pagedserve or vLLM), e.g. "
                     "http://127.0.0.1:8000/metrics")
    src.add_argument("--from-files", nargs=2, metavar=("BEFORE", "AFTER"),
                     help="two saved scrapes, --interval apart, instead of a live server")
    p.add_argument("--interval", type=parse_duration, default=30.0,
                   help="seconds between the first and last scrape (30s, 1m, 500ms); with --from-files, "
                        "the time between the two files")
    p.add_argument("--sample-every", type=parse_duration, default=2.0,
                   help="seconds between gauge samples during the interval")
    p.add_argument("--timeout", type=parse_duration, default=10.0, help="per-scrape HTTP timeout")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--gpu-util", type=float, metavar="PCT",
                   help="GPU utilisation (percent) read from nvidia-smi; replaces engine_busy_ratio")
    p.add_argument("--slo", nargs="+", metavar="NAME:MS",
                   help=f"latency SLOs (default ttft_p99:{d.ttft_p99_ms:g} itl_p99:{d.itl_p99_ms:g})")
    p.add_argument("--kv-high", type=float, default=d.kv_high, help="KV usage that counts as the top")
    p.add_argument("--kv-low", type=float, default=d.kv_low, help="mean KV usage below which the pool idles")
    p.add_argument("--kv-pinned-share", type=float, default=d.kv_pinned_share,
                   help="share of samples at --kv-high that counts as pinned")
    p.add_argument("--util-low", type=float, default=d.util_low, help="utilisation below which the GPU is not fed")
    p.add_argument("--util-high", type=float, default=d.util_high, help="utilisation counted as saturated")
    p.add_argument("--preemptions-per-min", type=float, default=d.preemptions_per_min,
                   help="preemption rate above which preemptions are 'rising'")
    p.add_argument("--long-prompt-tokens", type=float, default=d.long_prompt_tokens,
                   help="P90 prompt length counted as long")
    p.add_argument("--queue-share", type=float, default=d.queue_share,
                   help="share of samples with waiting > 0 counted as queueing")
    p.add_argument("--queue-ttft-share", type=float, default=d.queue_ttft_share,
                   help="queue-time P99 at least this share of TTFT P99 also counts as queueing")
    p.add_argument("--short-prompt-tokens", type=float, default=d.short_prompt_tokens,
                   help="P90 prompt length below which prefill cannot be what blocks TTFT")
    p.add_argument("--evicted-prefix-share", type=float, default=d.evicted_prefix_share,
                   help="share of prompt tokens missed on prefixes the cache evicted for room at which a host "
                        "KV tier (--kv-offloading-size) is suggested")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="the server's device, for how its knobs are spelled (auto: from its metrics where they "
                        "say, else both spellings)")
    p.add_argument("--gpu-memory-utilization-margin", type=float, default=d.gpu_memory_utilization_margin,
                   help="highest gpu_memory_utilization the advice will suggest")
    p.set_defaults(func=run)
    return p


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (the lead wires `register` into pagedserve/cli.py)."""
    parser = argparse.ArgumentParser(prog="pagedserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pagedserve advise: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(["advise"] + sys.argv[1:]))
