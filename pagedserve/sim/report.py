"""The serving report, as pure functions over per-request records.

Field names follow `vllm bench serve` (its --save-result JSON): request_throughput,
output_throughput, total_token_throughput, request_goodput, and mean/median/std/pNN of
ttft_ms, tpot_ms, itl_ms, e2el_ms. Definitions, as vLLM's:

* TTFT: first token time - arrival (send) time;
* TPOT per request: (E2E - TTFT) / (output tokens - 1), requests with >1 output token;
* ITL: every gap between consecutive tokens of a request, pooled over requests;
* E2EL: finish - arrival;
* throughputs divide by the run's duration; goodput counts only requests meeting every
  SLO given (ttft / tpot / e2el in ms), as vLLM's --goodput.

The simulator and the real-engine replay fill the same records, so their reports compare
field by field. Self-contained: numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

DEFAULT_PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    request_id: str
    arrival: float                       # when the request was sent (s)
    prompt_len: int
    output_len: int                      # tokens asked for
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    finish: float | None = None
    num_preemptions: int = 0
    failed: bool = False                 # rejected (e.g. longer than max_model_len)
    error: str = ""

    @property
    def completed(self) -> bool:
        return not self.failed and self.finish is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def e2el(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def tpot(self) -> float | None:
        n = self.num_output_tokens
        if n < 2 or self.finish is None or self.first_token_time is None:
            return None
        return (self.finish - self.first_token_time) / (n - 1)

    def itls(self) -> list[float]:
        t = self.token_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]


def summarize(values_s: Sequence[float], name: str, percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict:
    """mean/median/std/pNN of a list of seconds, in ms, keyed as vLLM keys them."""
    import numpy as np

    arr = np.asarray(values_s, dtype=float) * 1000.0
    out = {}
    if arr.size == 0:
        out[f"mean_{name}_ms"] = out[f"median_{name}_ms"] = out[f"std_{name}_ms"] = 0.0
        for p in percentiles:
            out[f"p{_pct_label(p)}_{name}_ms"] = 0.0
        return out
    out[f"mean_{name}_ms"] = float(arr.mean())
    out[f"median_{name}_ms"] = float(np.median(arr))
    out[f"std_{name}_ms"] = float(arr.std())
    for p in percentiles:
        out[f"p{_pct_label(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def _pct_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def meets_slo(rec: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """True when the request is within every SLO (keys: ttft, tpot, e2el; values in ms)."""
    for key, limit in slos_ms.items():
        value = {"ttft": rec.ttft, "tpot": rec.tpot, "e2el": rec.e2el}[key]
        if key == "tpot" and value is None:
            continue  # one-token outputs have no TPOT: vLLM counts them as meeting it
        if value is None or value * 1000.0 > limit:
            return False
    return True


def compute_metrics(records: Sequence[RequestRecord], duration: float, *, goodput_slos: dict[str, float] | None = None,
                    percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict:
    """The vLLM-bench report over `records` for a run of `duration` seconds."""
    done = [r for r in records if r.completed]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.num_output_tokens for r in done)
    duration = max(duration, 1e-12)
    itls: list[float] = []
    for r in done:
        itls.extend(r.itls())
    out = {
        "duration": duration,
        "completed": len(done),
        "failed": sum(1 for r in records if r.failed),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    if goodput_slos:
        good = sum(1 for r in done if meets_slo(r, goodput_slos))
        out["request_goodput"] = good / duration
    else:
        out["request_goodput"] = None
    out["goodput"] = out["request_goodput"]
    out.update(summarize([r.ttft for r in done if r.ttft is not None], "ttft", percentiles))
    out.update(summarize([r.tpot for r in done if r.tpot is not None], "tpot", percentiles))
    out.update(summarize(itls, "itl", percentiles))
    out.update(summarize([r.e2el for r in done if r.e2el is not None], "e2el", percentiles))
    out["num_preemptions"] = sum(r.num_preemptions for r in records)
    out["num_preempted_requests"] = sum(1 for r in records if r.num_preemptions)
    return out
