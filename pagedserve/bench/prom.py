"""Prometheus text exposition of pagedserve, vLLM (V1 or older) or llama.cpp → one normalised Snapshot.

The one parser of the project: `bench` samples a server during a run with it, `advise` judges an
interval with it, the tests read /metrics with it. Invariants of a Snapshot:
- every metric is keyed by its canonical name (`metric_names`): no server prefix, no counter
  `_total`, older and other servers' names mapped to pagedserve's, unless the scrape also has
  the canonical name (vLLM versions in transition export both, and then the old one may mean
  something else): the canonical one wins and the old one stays under its own name;
- series that differ only by labels are added together, except ratio gauges, which are averaged;
  counters and gauges also keep their per-label values (`by_label`), without the labels that only
  say where a series came from (model_name, engine);
- a histogram's buckets are cumulative `(upper bound, count)` pairs, +Inf last, as exposed.

Also here: the increase of counters and histograms between two snapshots (with Prometheus' reset
rule) and `histogram_quantile`, interpolating inside a bucket exactly as PromQL does. No torch;
no I/O but `fetch_text`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pagedserve import metric_names as mn

# Ratio gauges (averaged over series), under every name a scrape may use for them.
RATIO_GAUGES = frozenset({s.name for s in mn.METRICS if s.ratio}
                         | {old for old, (new, _) in mn.ALIASES.items() if mn.SPECS[new].ratio}
                         | {"cpu_cache_usage_perc"})

LabelKey = tuple[tuple[str, str], ...]


@dataclass
class Histogram:
    """Cumulative buckets as Prometheus exposes them: (upper bound, count ≤ bound), +Inf last."""
    buckets: list[tuple[float, float]] = field(default_factory=list)
    sum: float = 0.0
    count: float = 0.0

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self.buckets)


@dataclass
class Snapshot:
    """One scrape, normalised. `t` is when it was taken (seconds, the caller's clock); `naming` says
    which names were seen: pagedserve, vllm, llamacpp (+ vllm-v0 when an older vLLM name stood in)."""
    t: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    labelled: dict[str, dict[LabelKey, float]] = field(default_factory=dict)
    naming: set[str] = field(default_factory=set)

    def value(self, name: str) -> float | None:
        """A counter's or a gauge's value (summed or averaged over series); None when absent."""
        if name in self.counters:
            return self.counters[name]
        return self.gauges.get(name)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """A counter's or gauge's values added up per value of `label` ({} when absent)."""
        out: dict[str, float] = {}
        for labels, value in self.labelled.get(name, {}).items():
            key = dict(labels).get(label)
            if key is not None:
                out[key] = out.get(key, 0.0) + value
        return out


def split_prefix(raw: str) -> tuple[str, str | None]:
    """'vllm:kv_cache_usage_perc' → ('kv_cache_usage_perc', 'vllm'); unprefixed names pass through."""
    for prefix, naming in mn.PREFIXES.items():
        if raw.startswith(prefix):
            return raw[len(prefix):], naming
    return raw, None


def _strip(name: str, suffix: str) -> str:
    return name[: -len(suffix)] if name.endswith(suffix) else name


class _Reader:
    """Accumulates one scrape's samples before aliases are applied."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        self.ratio_series: dict[str, list[float]] = {}
        self.buckets: dict[str, dict[float, float]] = {}
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def _label(self, name: str, labels: dict, value: float) -> None:
        key = tuple(sorted((k, v) for k, v in labels.items() if k not in mn.SOURCE_LABELS))
        per = self.snap.labelled.setdefault(name, {})
        per[key] = per.get(key, 0.0) + value

    def counter(self, name: str, labels: dict, value: float) -> None:
        self.snap.counters[name] = self.snap.counters.get(name, 0.0) + value
        self._label(name, labels, value)

    def gauge(self, name: str, labels: dict, value: float) -> None:
        if name in RATIO_GAUGES:
            self.ratio_series.setdefault(name, []).append(value)
        else:
            self.snap.gauges[name] = self.snap.gauges.get(name, 0.0) + value
        self._label(name, labels, value)

    def bucket(self, base: str, le: float, value: float) -> None:
        per_le = self.buckets.setdefault(base, {})
        per_le[le] = per_le.get(le, 0.0) + value

    def add_sum(self, base: str, value: float) -> None:
        self.sums[base] = self.sums.get(base, 0.0) + value

    def add_count(self, base: str, value: float) -> None:
        self.counts[base] = self.counts.get(base, 0.0) + value

    def finish(self) -> Snapshot:
        snap = self.snap
        for name, values in self.ratio_series.items():
            snap.gauges[name] = sum(values) / len(values)
        for base, per_le in self.buckets.items():
            buckets = sorted(per_le.items())
            count = self.counts.get(base, buckets[-1][1] if buckets else 0.0)
            snap.histograms[base] = Histogram(buckets=buckets, sum=self.sums.get(base, 0.0), count=count)
        _apply_aliases(snap)
        return snap


def _apply_aliases(snap: Snapshot) -> None:
    for table in (snap.counters, snap.gauges, snap.histograms, snap.labelled):
        for old, (new, naming) in mn.ALIASES.items():
            if old in table and new not in table:
                table[new] = table.pop(old)
                if naming == "vllm-v0":
                    snap.naming.add(naming)


_SERIES_SUFFIXES = ("_total", "_created", "_bucket", "_sum", "_count")


def select_families(text: str, names) -> str:
    """The lines of `text` (Prometheus text exposition) that belong to the canonical metrics
    `names` under any naming (server prefix, counter `_total`, histogram series, the older and
    other servers' names in `metric_names.ALIASES`); comments of other families and their
    samples are dropped. A plain string pass: ~0.5 ms on a 750-line pagedserve scrape, whose full
    parse takes ~12 ms."""
    bases = set(names)
    bases |= {old for old, (new, _) in mn.ALIASES.items() if new in bases}
    raw_names = {prefix + base + suffix for base in bases for prefix in ("", *mn.PREFIXES)
                 for suffix in ("", *_SERIES_SUFFIXES)}
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("TYPE", "HELP", "UNIT") and parts[2] in raw_names:
                out.append(line)
        elif line.split("{", 1)[0].split(" ", 1)[0] in raw_names:
            out.append(line)
    return "\n".join(out) + "\n" if out else ""


def parse_metrics(text: str, t: float = 0.0, only=None) -> Snapshot:
    """Parse Prometheus text exposition (any of the namings) into a Snapshot taken at `t`.

    Families without a `# TYPE` line are taken as gauges, except `*_total` (counters) and
    `*_bucket{le=...}` / `*_sum` / `*_count` next to such buckets (histograms). Summaries, infos
    and statesets are skipped: nothing here reads them.

    `only`: canonical names to read; the others are dropped before parsing (`select_families`).
    `bench` samples a server every 0.5 s while the run streams, on the loop that stamps each
    token's arrival: a full parse of pagedserve's ~750-line scrape (~600 histogram buckets) took
    ~10-14 ms of that loop, and every stream's next token looked that much late."""
    if only is not None:
        text = select_families(text, only)
    reader = _Reader(Snapshot(t=t))
    untyped: list[tuple[str, dict, float]] = []
    families = list(text_string_to_metric_families(text))
    # A pagedserve server with --metric-names both shows a quantity twice (pagedserve:* and
    # vllm:*): read pagedserve's copy (finer bounds) and never add the two.
    ours = {f.name[len(mn.PREFIX):] for f in families if f.name.startswith(mn.PREFIX)}
    for family in families:
        if family.name.startswith(mn.VLLM_PREFIX) and family.name[len(mn.VLLM_PREFIX):] in ours:
            continue
        if family.type in ("unknown", "untyped"):
            untyped.extend((s.name, s.labels, s.value) for s in family.samples)
            continue
        if family.type not in ("counter", "gauge", "histogram"):
            continue
        base, naming = split_prefix(family.name)
        if naming:
            reader.snap.naming.add(naming)
        for sample in family.samples:
            if family.type == "counter":
                if not sample.name.endswith("_created"):
                    reader.counter(_strip(base, "_total"), sample.labels, sample.value)
            elif family.type == "gauge":
                reader.gauge(base, sample.labels, sample.value)
            elif sample.name.endswith("_bucket"):
                reader.bucket(base, float(sample.labels["le"]), sample.value)
            elif sample.name.endswith("_sum"):
                reader.add_sum(base, sample.value)
            elif sample.name.endswith("_count"):
                reader.add_count(base, sample.value)
    _read_untyped(reader, untyped)
    return reader.finish()


def _read_untyped(reader: _Reader, untyped: list[tuple[str, dict, float]]) -> None:
    """Hand-written or stripped scrapes: guess each sample's kind from its name."""
    bucket_bases = {n[: -len("_bucket")] for n, labels, _ in untyped if n.endswith("_bucket") and "le" in labels}
    for raw, labels, value in untyped:
        name, naming = split_prefix(raw)
        if naming:
            reader.snap.naming.add(naming)
        if raw.endswith("_bucket") and "le" in labels:
            reader.bucket(name[: -len("_bucket")], float(labels["le"]), value)
        elif raw.endswith("_sum") and raw[: -len("_sum")] in bucket_bases:
            reader.add_sum(name[: -len("_sum")], value)
        elif raw.endswith("_count") and raw[: -len("_count")] in bucket_bases:
            reader.add_count(name[: -len("_count")], value)
        elif raw.endswith("_total"):
            reader.counter(name[: -len("_total")], labels, value)
        else:
            reader.gauge(name, labels, value)


def naming_label(naming: set[str]) -> str:
    """Human words for the names a scrape used."""
    if "pagedserve" in naming:
        return "pagedserve"
    if "vllm-v0" in naming:
        return "vllm (older V0 names)"
    if "vllm" in naming:
        return "vllm"
    if "llamacpp" in naming:
        return "llama.cpp"
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


def fetch_text(url: str, timeout: float = 10.0) -> str:
    """GET a /metrics page; a clear ValueError if the server does not answer with 200."""
    import httpx

    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.HTTPError as e:
        raise ValueError(f"could not scrape {url}: {e}") from e
    if response.status_code != 200:
        raise ValueError(f"could not scrape {url}: HTTP {response.status_code}")
    return response.text
