"""Write deploy/grafana-dashboard.json from the metric names table (run: python deploy/make_dashboard.py).

The dashboard is generated so that its rules hold by construction, and tests/test_metrics.py checks
the committed JSON is what this script writes:
- one data-source mechanism: a `datasource` template variable (a dropdown); every panel and query
  points at `${datasource}`. No `__inputs`, which would pin one UID at import and leave the dropdown dead;
- every quantile has its mean beside it, `sum(rate(_sum)) / sum(rate(_count))`, which is exact
  where a histogram_quantile is only as good as the bucket it lands in;
- every series is split by `instance` and says so in its legend (`{{instance}}`), so several servers
  behind one Prometheus are told apart;
- counts (preemptions per request, tokens per step, prompt and output length) are whole numbers with a
  bound at every integer up to 10: their quantiles are shown as `ceil(histogram_quantile(...))`,
  which is then exact there, and changes a reading above 10 by less than one token.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve import metric_names as mn  # noqa: E402

PATH = Path(__file__).resolve().parent / "grafana-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SELECTOR = '{model_name=~"$model_name", instance=~"$instance"}'
QUANTILES = (0.5, 0.9, 0.99)
COUNTS = ("Whole numbers with a bucket bound at every integer up to 10: ceil() of the interpolated quantile "
          "is exact there.")


def series(name: str, suffix: str = "") -> str:
    return f"{mn.PREFIX}{name}{suffix}{SELECTOR}"


def rate(name: str, suffix: str = "", by: str = "instance") -> str:
    return f"sum by({by}) (rate({series(name, suffix)}[$__rate_interval]))"


def quantile_targets(histogram: str, whole_numbers: bool = False) -> list[tuple[str, str]]:
    """P50/P90/P99 per instance, then the mean."""
    out = []
    for q in QUANTILES:
        expr = f"histogram_quantile({q}, {rate(histogram, '_bucket', by='le, instance')})"
        if whole_numbers:
            expr = f"ceil({expr})"
        out.append((expr, f"P{q * 100:g} {{{{instance}}}}"))
    mean = f"{rate(histogram, '_sum')} / {rate(histogram, '_count')}"
    out.append((mean, "mean {{instance}}"))
    return out


def panel(title: str, targets: list[tuple[str, str]], unit: str = "short", description: str = "") -> dict:
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": DATASOURCE}
                    for i, (expr, legend) in enumerate(targets)],
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def rows() -> list[tuple[dict, list[dict]]]:
    gauge = lambda name, label: (series(name), f"{label} {{{{instance}}}}")  # noqa: E731
    latency = ("Quantiles are interpolated inside the bucket that holds them (bounds 18-25% apart); "
               "the mean line is exact.")
    return [
        (row("KV cache"), [
            panel("KV cache usage", [gauge(mn.KV_CACHE_USAGE_PERC, "usage")], "percentunit",
                  "Share of the block pool held by requests. Near 1 with preemptions rising: the pool is the "
                  "bottleneck."),
            panel("KV cache tokens", [gauge(mn.KV_CACHE_USED_TOKENS, "used"),
                                      gauge(mn.KV_CACHE_TOTAL_TOKENS, "pool size")]),
            panel("Prefix cache hit rate",
                  [(f"{rate(mn.PREFIX_CACHE_HITS, '_total')} / {rate(mn.PREFIX_CACHE_QUERIES, '_total')}",
                    "hit rate {{instance}}")], "percentunit",
                  "Prompt tokens found in the prefix cache over prompt tokens looked up."),
        ]),
        (row("Preemption"), [
            panel("Preemptions / s", [(rate(mn.NUM_PREEMPTIONS, "_total", by="instance, mode"),
                                       "{{mode}} {{instance}}")]),
            panel("Recomputed tokens / s and swapped blocks / s",
                  [(rate(mn.RECOMPUTED_TOKENS, "_total"), "recomputed tokens {{instance}}"),
                   (rate(mn.SWAPPED_BLOCKS, "_total", by="instance, direction"),
                    "swapped blocks {{direction}} {{instance}}")]),
            panel("Preemptions per finished request", quantile_targets(mn.REQUEST_NUM_PREEMPTIONS, whole_numbers=True),
                  description=COUNTS),
        ]),
        (row("Latency"), [
            panel("Time to first token", quantile_targets(mn.TIME_TO_FIRST_TOKEN), "s", latency),
            panel("Inter-token latency", quantile_targets(mn.INTER_TOKEN_LATENCY), "s", latency),
            panel("End-to-end request latency", quantile_targets(mn.E2E_REQUEST_LATENCY), "s", latency),
            panel("Queue time", quantile_targets(mn.REQUEST_QUEUE_TIME), "s", latency),
            panel("Engine step time", quantile_targets(mn.ENGINE_STEP), "s", latency),
            panel("Tokens per step", quantile_targets(mn.ITERATION_TOKENS, whole_numbers=True),
                  description="Decode steps carry one token per running request, prefill steps up to "
                              "max_num_batched_tokens. " + COUNTS),
        ]),
        (row("Load and utilisation"), [
            panel("Requests", [gauge(mn.NUM_REQUESTS_RUNNING, "running"), gauge(mn.NUM_REQUESTS_WAITING, "waiting"),
                               gauge(mn.NUM_REQUESTS_SWAPPED, "swapped")]),
            panel("Engine busy ratio (utilisation)", [gauge(mn.ENGINE_BUSY_RATIO, "busy")], "percentunit"),
            panel("Token throughput", [(rate(mn.PROMPT_TOKENS, "_total"), "prompt tokens/s {{instance}}"),
                                       (rate(mn.GENERATION_TOKENS, "_total"), "generation tokens/s {{instance}}")]),
            panel("Finished requests / s", [(rate(mn.REQUEST_SUCCESS, "_total", by="instance, finished_reason"),
                                             "{{finished_reason}} {{instance}}")]),
            panel("Prompt length (tokens)", quantile_targets(mn.REQUEST_PROMPT_TOKENS, whole_numbers=True),
                  description=COUNTS + " Above 10, bounds 7-15% apart."),
            panel("Output length (tokens)", quantile_targets(mn.REQUEST_GENERATION_TOKENS, whole_numbers=True),
                  description=COUNTS + " Above 10, bounds 7-15% apart."),
        ]),
    ]


def template_variable(name: str, label: str) -> dict:
    return {"name": name, "type": "query", "label": label, "datasource": DATASOURCE,
            "query": {"query": f"label_values({mn.PREFIX}{mn.NUM_REQUESTS_RUNNING}, {name})", "refId": name},
            "includeAll": True, "multi": True, "current": {}, "refresh": 2, "allValue": ".*"}


def dashboard() -> dict:
    panels, next_id, y = [], 1, 0
    for header, members in rows():
        panels.append({"id": next_id, **header, "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}})
        next_id, y = next_id + 1, y + 1
        for i, p in enumerate(members):
            panels.append({"id": next_id, **p, "gridPos": {"x": 8 * (i % 3), "y": y + 8 * (i // 3), "w": 8, "h": 8}})
            next_id += 1
        y += 8 * ((len(members) + 2) // 3)
    return {
        "title": "pagedserve", "uid": "pagedserve-overview", "tags": ["pagedserve", "llm", "inference"],
        "timezone": "browser", "schemaVersion": 39, "version": 2, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source",
             "current": {}, "hide": 0},
            template_variable("model_name", "Model"),
            template_variable("instance", "Instance"),
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    PATH.write_text(render())
    print(f"wrote {PATH}")
