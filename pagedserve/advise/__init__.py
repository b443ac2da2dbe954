"""`pagedserve advise`: from live metrics to the knob to move first.

Pure Python, no torch: `bench.prom` (the project's one Prometheus parser) normalizes scrapes and
computes interval rates and histogram quantiles, `advisor` applies the source articles' symptom → cause → knob rules
(`judge`: the one verdict on a window, for `pagedserve advise` and the dashboard alike), `cli`
is the `pagedserve advise` sub-command. It sits below the dashboard (which shows the live verdict)
and the tuner, and reads nothing above the metrics.
"""
from pagedserve.advise.advisor import (Finding, Observations, Report, Thresholds, advise, format_report, judge,
                                       observe)
from pagedserve.bench.prom import Histogram, Snapshot, histogram_quantile, parse_metrics

__all__ = ["Finding", "Observations", "Report", "Thresholds", "advise", "format_report", "judge", "observe",
           "Histogram", "Snapshot", "histogram_quantile", "parse_metrics"]
