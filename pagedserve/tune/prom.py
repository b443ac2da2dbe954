"""Prometheus scrapes in pagedserve's or vLLM's naming → one normalized snapshot.

A snapshot keys every metric by its *canonical* name: the name without the `pagedserve:` /
`vllm:` prefix, without a counter's `_total`, and with vLLM's older names mapped to the newer
ones (`gpu_cache_usage_perc` → `kv_cache_usage_perc`, `time_per_output_token_seconds` →
`inter_token_latency_seconds`). Series that differ only by labels (model_name, preemption mode,
finish reason, engine index) are added together, except ratio gauges, which are averaged.

Also here: the difference of two snapshots over an interval (counters and histogram buckets,
with Prometheus' reset rule) and `histogram_quantile`, interpolating within a bucket as
Prometheus does. No torch, no I/O but the optional httpx scrape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("pagedserve:", "vllm:")

# Older name → canonical name. The canonical names are vLLM's newer ones, which pagedserve uses.
ALIASES = {
    "gpu_cache_usage_perc": "kv_cache_usage_perc",                  # vLLM V0
    "time_per_output_token_seconds": "inter_token_latency_seconds",  # vLLM V0 (per-token gap)
}

# Canonical name → (kind, what it is). The advisor reads these; everything else is kept too.
KNOWN = {
    "kv_cache_usage_perc": ("gauge", "share of KV-cache blocks in use (1 = full)"),
    "num_requests_running": ("gauge", "requests in the running batch"),
    "num_requests_waiting": ("gauge", "requests queued, not yet scheduled"),
    "num_requests_swapped": ("gauge", "requests swapped out to host memory"),
    "engine_busy_ratio": ("gauge", "share of wall time in the model forward (pagedserve only)"),
    "num_preemptions": ("counter", "preemptions (all modes)"),
    "prompt_tokens": ("counter", "prefill tokens processed"),
    "generation_tokens": ("counter", "tokens generated"),
    "request_success": ("counter", "finished requests (all reasons)"),
    "time_to_first_token_seconds": ("histogram", "TTFT"),
    "inter_token_latency_seconds": ("histogram", "ITL"),
    "e2e_request_latency_seconds": ("histogram", "end-to-end latency"),
    "request_queue_time_seconds": ("histogram", "time queued before first scheduled"),
    "request_prompt_tokens": ("histogram", "prompt length per finished request"),
    "iteration_tokens_total": ("histogram", "tokens per engine step"),
}

# Gauges that are ratios: several series (engines, models) are averaged, not summed.
RATIO_GAUGES = {"kv_cache_usage_perc", "gpu_cache_usage_perc", "cpu_cache_usage_perc", "engine_busy_ratio"}


@dataclass
class Histogram:
    """Cumulative buckets as Prometheus exposes them: (upper bound, count ≤ bound), +Inf last."""
    buckets: list[tuple[float, float]] = field(default_factory=list)
    sum: float = 0.0
    count: float = 0.0

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


@dataclass
class Snapshot:
    """One scrape, normalized. `naming` says which names were seen: pagedserve, vllm (+ vllm-v0 when
    an older vLLM name stood in for a newer one)."""
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    naming: set[str] = field(default_factory=set)


def canonical_name(raw: str) -> tuple[str, str | None]:
    """('vllm:kv_cache_usage_perc') → ('kv_cache_usage_perc', 'vllm'); unprefixed names pass through.
    Old names stay old here; `_apply_aliases` maps them once the whole scrape is read."""
    for prefix in PREFIXES:
        if raw.startswith(prefix):
            return raw[len(prefix):], prefix[:-1]
    return raw, None


def _apply_aliases(snap: "Snapshot") -> None:
    """Old name → new name, unless the scrape has the new one too (vLLM versions in transition export
    both, and e.g. V0's time_per_output_token_seconds then means something else): the new one wins."""
    for table in (snap.counters, snap.gauges, snap.histograms):
        for old, new in ALIASES.items():
            if old in table and new not in table:
                table[new] = table.pop(old)
                if "vllm" in snap.naming:
                    snap.naming.add("vllm-v0")


def _strip(name: str, suffix: str) -> str:
    return name[: -len(suffix)] if name.endswith(suffix) else name


def parse_metrics(text: str) -> Snapshot:
    """Parse Prometheus text exposition (either naming) into a Snapshot.

    Families without a `# TYPE` line are taken as gauges, except `*_total` (counters) and
    `*_bucket{le=...}` / `*_sum` / `*_count` next to such buckets (histograms).
    """
    snap = Snapshot()
    ratio_series: dict[str, list[float]] = {}
    hist_buckets: dict[str, dict[float, float]] = {}
    hist_sum: dict[str, float] = {}
    hist_count: dict[str, float] = {}
    untyped: list[tuple[str, dict, float]] = []

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.type == "counter":
                if sample.name.endswith("_created"):
                    continue
                name, naming = canonical_name(_strip(sample.name, "_total"))
                snap.counters[name] = snap.counters.get(name, 0.0) + sample.value
            elif family.type == "gauge":
                name, naming = canonical_name(sample.name)
                if name in RATIO_GAUGES:
                    ratio_series.setdefault(name, []).append(sample.value)
                else:
                    snap.gauges[name] = snap.gauges.get(name, 0.0) + sample.value
            elif family.type == "histogram":
                base, naming = canonical_name(family.name)
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    per_le = hist_buckets.setdefault(base, {})
                    per_le[le] = per_le.get(le, 0.0) + sample.value
                elif sample.name.endswith("_sum"):
                    hist_sum[base] = hist_sum.get(base, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    hist_count[base] = hist_count.get(base, 0.0) + sample.value
                else:
                    continue
            elif family.type in ("unknown", "untyped"):
                untyped.append((sample.name, sample.labels, sample.value))
                naming = None
            else:  # summary, info, stateset, gaugehistogram: the advisor needs none of them
                continue
            if naming:
                snap.naming.add(naming)

    # Untyped lines (hand-written or stripped scrapes): guess from the name.
    bucket_bases = {n[: -len("_bucket")] for n, labels, _ in untyped if n.endswith("_bucket") and "le" in labels}
    for raw, labels, value in untyped:
        naming = None
        if raw.endswith("_bucket") and "le" in labels:
            base, naming = canonical_name(raw[: -len("_bucket")])
            per_le = hist_buckets.setdefault(base, {})
            le = float(labels["le"])
            per_le[le] = per_le.get(le, 0.0) + value
        elif raw.endswith("_sum") and raw[: -len("_sum")] in bucket_bases:
            base, naming = canonical_name(raw[: -len("_sum")])
            hist_sum[base] = hist_sum.get(base, 0.0) + value
        elif raw.endswith("_count") and raw[: -len("_count")] in bucket_bases:
            base, naming = canonical_name(raw[: -len("_count")])
            hist_count[base] = hist_count.get(base, 0.0) + value
        elif raw.endswith("_total"):
            name, naming = canonical_name(raw[: -len("_total")])
            snap.counters[name] = snap.counters.get(name, 0.0) + value
        else:
            name, naming = canonical_name(raw)
            if name in RATIO_GAUGES:
                ratio_series.setdefault(name, []).append(value)
            else:
                snap.gauges[name] = snap.gauges.get(name, 0.0) + value
        if naming:
            snap.naming.add(naming)

    for name, values in ratio_series.items():
        snap.gauges[name] = sum(values) / len(values)
    for base, per_le in hist_buckets.items():
        buckets = sorted(per_le.items())
        count = hist_count.get(base, buckets[-1][1] if buckets else 0.0)
        snap.histograms[base] = Histogram(buckets=buckets, sum=hist_sum.get(base, 0.0), count=count)
    _apply_aliases(snap)
    return snap


def naming_label(naming: set[str]) -> str:
    """Human words for the names a scrape used."""
    if "pagedserve" in naming:
        return "pagedserve"
    if "vllm-v0" in naming:
        return "vllm (older V0 names)"
    if "vllm" in naming:
        return "vllm"
    return "unprefixed"


# -- interval arithmetic ------------------------------------------------------------------------

def counter_delta(before: float | None, after: float | None) -> tuple[float | None, bool]:
    """Increase over the interval and whether the counter was reset (Prometheus: then take `after`)."""
    if after is None:
        return None, False
    if before is None:
        return after, False
    if after < before:
        return after, True
    return after - before, False


def histogram_delta(before: Histogram | None, after: Histogram | None) -> tuple[Histogram | None, bool]:
    """Observations made between two scrapes: bucket by bucket `after - before` (reset → `after`)."""
    if after is None:
        return None, False
    if before is None:
        return after, False
    earlier = dict(before.buckets)
    if after.count < before.count or any(count < earlier.get(le, 0.0) for le, count in after.buckets):
        return after, True
    buckets = [(le, count - earlier.get(le, 0.0)) for le, count in after.buckets]
    return Histogram(buckets=buckets, sum=after.sum - before.sum, count=after.count - before.count), False


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative `(upper_bound, count)` buckets, as PromQL's histogram_quantile.

    Linear interpolation inside the bucket holding rank q·total; the first bucket's lower bound is
    0 (or its upper bound if that is ≤ 0); a rank in the +Inf bucket returns the highest finite
    bound. None when there are no observations or fewer than two buckets.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    buckets = sorted(buckets)
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]):
        return None
    # Counts must not fall with the bound (a scrape can race a histogram update): keep them monotone.
    fixed, running_max = [], 0.0
    for le, count in buckets:
        running_max = max(running_max, count)
        fixed.append((le, running_max))
    total = fixed[-1][1]
    if total <= 0:
        return None
    rank = q * total
    index = next(i for i, (_, count) in enumerate(fixed) if count >= rank)
    if index == len(fixed) - 1:
        return fixed[-2][0]
    upper, count_upto = fixed[index]
    if index == 0:
        if upper <= 0:
            return upper
        lower, count_before = 0.0, 0.0
    else:
        lower, count_before = fixed[index - 1]
    in_bucket = count_upto - count_before
    if in_bucket <= 0:
        return upper
    return lower + (upper - lower) * (rank - count_before) / in_bucket


def scrape(url: str, timeout: float = 10.0) -> str:
    """GET a /metrics page; a clear ValueError if the server does not answer with 200."""
    import httpx

    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.HTTPError as e:
        raise ValueError(f"could not scrape {url}: {e}") from e
    if response.status_code != 200:
        raise ValueError(f"could not scrape {url}: HTTP {response.status_code}")
    return response.text
