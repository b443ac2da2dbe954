"""The /metrics text of an EngineMetrics' collectors, cheap enough for the API event loop.

prometheus_client's `generate_latest` builds a `Sample` per series line on every scrape (a
label dict, the bucket bound formatted again, the labels sorted and escaped again): ~600
histogram buckets cost ~5 ms of CPU on the loop that streams every token, so each scrape held
every stream's next token (benchmarks/README.md, issue 31). This writes the same text (the
Prometheus text format as `generate_latest` writes it: the same families in the same order,
each series' labels sorted, each value as `floatToGoString` prints it) by joining one list of
strings: the fixed text (every HELP / TYPE line, every line up to its value), built once and
rebuilt only when a family's set of children changes (a new label set, `clear()`), and between
those pieces the values of this scrape: each histogram's buckets read and added up, and
formatted, in one C-level pass each (bucket counts below 10^6 print as `repr`, which is what
`floatToGoString` gives them). A `str.format` template of the same text cost twice as much: it
scans all ~60 kB of fixed text on every call.

It reads the values where prometheus_client keeps them (a labelled metric's children, a
histogram's per-bucket counts and sum, a counter's or gauge's value) without their per-value
locks, one value at a time as `generate_latest` does: a scrape concurrent with an observation
may count it in the sum and not yet in its bucket, with either renderer. `supports()` says
whether a collector is one it knows (the three plain types, single-process values); for
anything else `EngineMetrics.render` uses `generate_latest`. tests/test_metrics.py checks that
the text parses to the same samples as `generate_latest` on the same registry.
"""
from __future__ import annotations

import threading
from itertools import accumulate
from operator import attrgetter

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client import metrics as prom_metrics
from prometheus_client import values as prom_values
from prometheus_client.utils import floatToGoString

_VALUE = attrgetter("_value")
# floatToGoString(x) is repr(x) (= str(x)) for finite x < 1e6; from 1e6 on Go's exponent form.
_REPR_BELOW = 1e6
_NEG_INF = float("-inf")

_KINDS = {Counter: "counter", Gauge: "gauge", Histogram: "histogram"}


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _label_text(pairs) -> str:
    """`{a="1",b="2"}` with the labels sorted by name, as generate_latest writes them ('' if none)."""
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label_value(v)}"' for k, v in sorted(pairs)) + "}"


def created_series_on() -> bool:
    """Whether prometheus_client writes a `_created` series beside each counter and histogram
    (metrics.py turns them off, as vLLM does; something calling enable_created_metrics() turns
    them back on for the whole process): the fast path writes none, so then it must not be used."""
    return bool(getattr(prom_metrics, "_use_created", True))


def supports(collector) -> bool:
    """Whether `Exposition` renders this collector exactly: a plain Counter, Gauge or Histogram
    (no subclass, no unit) of single-process values, with the attributes it reads."""
    if type(collector) not in _KINDS or prom_values.ValueClass is not prom_values.MutexValue:
        return False
    needed = ("_name", "_documentation", "_labelnames", "_labelvalues", "_type")
    if not all(hasattr(collector, a) for a in needed) or collector._labelvalues or getattr(collector, "_unit", ""):
        return False
    if collector._labelnames:
        return hasattr(collector, "_metrics") and hasattr(collector, "_lock")
    if type(collector) is Histogram:
        return all(hasattr(collector, a) for a in ("_buckets", "_sum", "_upper_bounds"))
    return hasattr(collector, "_value") and hasattr(collector._value, "_value")


class _Family:
    """One collector: its header, and per child series the text of each of its lines up to the
    value (rebuilt when the set of children changes: a new label set, `clear()`)."""

    def __init__(self, collector) -> None:
        self.collector = collector
        self.kind = _KINDS[type(collector)]
        name = collector._name
        self.sample_name = name + "_total" if self.kind == "counter" else name
        doc = _escape_help(collector._documentation)
        self.header = f"# HELP {self.sample_name} {doc}\n# TYPE {self.sample_name} {self.kind}\n"
        self.children_seen: tuple | None = None
        self.series: list = []    # (child, with_sum) per child series, in the registry's order
        self.prefixes: list = []  # per value line, its text up to the value ("name{labels} ")

    def children(self) -> tuple:
        c = self.collector
        if not c._labelnames:
            return (((), c),)
        with c._lock:
            return tuple(c._metrics.items())

    def rebuild(self, children: tuple) -> None:
        prefixes, series = [], []
        for labelvalues, child in children:
            pairs = list(zip(self.collector._labelnames, labelvalues))
            if self.kind != "histogram":
                prefixes.append(self.sample_name + _label_text(pairs) + " ")
                series.append((child, False))
                continue
            name = self.sample_name
            for bound in child._upper_bounds:
                prefixes.append(f"{name}_bucket{_label_text(pairs + [('le', floatToGoString(bound))])} ")
            labels = _label_text(pairs)
            prefixes.append(f"{name}_count{labels} ")
            with_sum = child._upper_bounds[0] >= 0  # as prometheus_client: no _sum with negative bounds
            if with_sum:
                prefixes.append(f"{name}_sum{labels} ")
            series.append((child, with_sum))
        self.prefixes, self.series, self.children_seen = prefixes, series, children

    def values(self, out: list) -> None:
        """Append this family's values as floatToGoString writes them, in its prefixes' order."""
        if self.kind == "histogram":
            for child, with_sum in self.series:
                cumulative = list(accumulate(map(_VALUE, child._buckets)))
                n = cumulative[-1]
                # Counts are >= 0, so below 1e6 floatToGoString is repr (one C-level pass).
                out += map(repr if n < _REPR_BELOW else floatToGoString, cumulative)
                out.append(out[-1])  # _count: the +Inf bucket's
                if with_sum:
                    out.append(_go(child._sum._value))
            return
        for child, _ in self.series:
            if "_child_samples" in child.__dict__:  # Gauge.set_function: its function gives the value
                out.append(_go(child._child_samples()[0].value))
            else:
                out.append(_go(child._value._value))


def _go(value) -> str:
    """floatToGoString(value), its common case (a finite float below 1e6, where it is repr) first."""
    value = float(value)
    return repr(value) if _NEG_INF < value < _REPR_BELOW else floatToGoString(value)


class Exposition:
    """The text of `collectors` (in registration order, as the registry collects them) as one
    list of strings to join: the fixed text (headers, each line up to its value, newlines) in
    the even slots, built once, and each render's values dropped into the odd ones."""

    def __init__(self, collectors) -> None:
        self._families = [_Family(c) for c in collectors]
        self._parts: list[str] = []
        self._lock = threading.Lock()  # two threads' renders: one rebuilds while the other fills

    def render(self) -> bytes:
        with self._lock:
            return self._render()

    def _render(self) -> bytes:
        stale = not self._parts
        for family in self._families:
            children = family.children()
            if children != family.children_seen:
                family.rebuild(children)
                stale = True
        if stale:
            self._parts = self._fixed_parts()
        values: list[str] = []
        for family in self._families:
            family.values(values)
        parts = self._parts
        parts[1::2] = values
        return "".join(parts).encode("utf-8")

    def _fixed_parts(self) -> list[str]:
        """[text before value 0, value 0, text between values 0 and 1, ..., text after the last]."""
        parts, pending = [], ""
        for family in self._families:
            pending += family.header
            for prefix in family.prefixes:
                parts += [pending + prefix, ""]
                pending = "\n"
        parts.append(pending)
        return parts
