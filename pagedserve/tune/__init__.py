"""Tuning from live metrics: parse Prometheus scrapes (pagedserve or vLLM names) and advise a knob.

Pure Python, no torch: `bench.prom` (the project's one Prometheus parser) normalizes scrapes and
computes interval rates and histogram quantiles, `advisor` applies the source articles' symptom → cause → knob rules
(`judge`: the one verdict on a window, for `pagedserve advise` and the dashboard alike), `advise_cli`
is the `pagedserve advise` sub-command.
"""
from pagedserve.tune.advisor import (Finding, Observations, Report, Thresholds, advise, format_report, judge,
                                     observe)
from pagedserve.bench.prom import Histogram, Snapshot, histogram_quantile, parse_metrics

__all__ = ["Finding", "Observations", "Report", "Thresholds", "advise", "format_report", "judge", "observe",
           "Histogram", "Snapshot", "histogram_quantile", "parse_metrics"]
