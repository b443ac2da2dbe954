"""The simulator's result dict: the bench's report over the records a simulation filled.

No statistics are computed here: `compute_metrics` hands the records to `bench/report.py` (the
project's one latency-report builder, definitions and empty-series rule there) and spells the
result in vLLM's --save-result naming, the shape `pagedserve simulate --result-json`,
`pagedserve tune` and the benchmarks read:

  duration, completed, failed, total_input_tokens, total_output_tokens, request_throughput,
  output_throughput, total_token_throughput, request_goodput (None without SLOs), goodput,
  {mean,median,std,p50,p90,p95,p99}_{ttft,tpot,itl,e2el}_ms, num_preemptions,
  num_preempted_requests.

`RequestRecord` lives in bench (the in-process replay fills it too); it is re-exported here for
the simulator.
"""
from __future__ import annotations

from typing import Sequence

from pagedserve.bench.report import RequestRecord, results_from_records, summarize, vllm_flat_keys

__all__ = ["RequestRecord", "compute_metrics"]


def compute_metrics(records: Sequence[RequestRecord], duration: float, *,
                    goodput_slos: dict[str, float] | None = None) -> dict:
    """The vLLM-bench report over `records` for a run of `duration` seconds."""
    summary = summarize(results_from_records(list(records)), duration, goodput_slos or None)
    goodput = summary.get("request_goodput")
    out = {
        "duration": duration,
        "completed": summary["successful_requests"],
        "failed": sum(1 for r in records if r.failed),   # rejected; a request still running is neither
        "total_input_tokens": summary["total_input_tokens"],
        "total_output_tokens": summary["total_output_tokens"],
        "request_throughput": summary["request_throughput"],
        "output_throughput": summary["output_throughput"],
        "total_token_throughput": summary["total_token_throughput"],
        "request_goodput": goodput,
        "goodput": goodput,
    }
    out.update(vllm_flat_keys(summary))
    out["num_preemptions"] = sum(r.num_preemptions for r in records)
    out["num_preempted_requests"] = sum(1 for r in records if r.num_preemptions)
    return out
