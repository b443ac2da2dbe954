"""The serving layer's fit (ServingOverhead) from the server's request trace joined to its step
trace and, when given, the client's bench result. Split out of cost_model.py."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from pagedserve.core.engine_core import StepTrace
from pagedserve.sim.calibration import _nnls
from pagedserve.sim.host_overhead import ServingOverhead, scatter_quantiles

# -- the serving layer ------------------------------------------------------------------
def read_request_trace(path: str | Path) -> list[dict]:
    """The server's request trace (pagedserve/server/request_trace.py), one dict per line."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    if not out:
        raise ValueError(f"request_trace: {path} holds no requests")
    return out


def match_client_records(requests: list[dict], bench_result: dict) -> int:
    """Give each server request record the client's view of it, from a `pagedserve bench
    --result-file`: `t_send` (the client sent it), `t_client_first` and `t_client_last` (its
    first and last token reached the client), on the server's clock. Matched by prompt length, each server
    record to the latest unmatched send at or before its HTTP arrival. Returns how many
    matched. The client's own clock is CLOCK_MONOTONIC like the server's (same machine)."""
    start = bench_result.get("run_start_monotonic")
    if start is None:
        raise ValueError("bench_result: no run_start_monotonic (made by an older pagedserve bench); "
                         "rerun the bench, or calibrate from the server's trace alone")
    sends: dict[int, list[tuple[float, dict]]] = {}
    for r in bench_result.get("requests", []):
        if r.get("success"):
            sends.setdefault(int(r["prompt_len"]), []).append((start + r["start"], r))
    for lst in sends.values():
        lst.sort(key=lambda x: x[0])
    used: set[int] = set()
    matched = 0
    for req in sorted(requests, key=lambda q: q.get("t_http") or q["t_submit"]):
        t = req.get("t_http") or req["t_submit"]
        best = None
        for send, r in sends.get(int(req["prompt_len"]), []):
            if send > t + 1e-3:
                break
            if id(r) not in used:
                best = (send, r)
        if best is None:
            continue
        used.add(id(best[1]))
        req["t_send"] = best[0]
        req["t_client_first"] = best[0] + best[1]["ttft"]
        req["t_client_last"] = req["t_client_first"] + sum(best[1].get("itl") or [])
        # every chunk's arrival (fit_serving's delivery jitter): the gaps after the first one, and
        # the tokens the client got
        req["t_client_itl"] = list(best[1].get("itl") or [])
        req["client_tokens"] = best[1].get("output_tokens")
        matched += 1
    return matched


def fit_serving(requests: Sequence[dict], steps: Sequence[StepTrace]) -> tuple[ServingOverhead, dict]:
    """Fit ServingOverhead from the request trace joined to its step trace.

    admission = t_submit - (t_send if the client's view was matched, else t_http), regressed
    on (1, prompt tokens) over the requests that found the serving layer free (every earlier
    request already handed to the engine): a burst queues at the HTTP loop and the tokenizer
    thread, and the overload phase of a calibration run would otherwise set the mean for
    every load (under overload the engine's queue dwarfs it anyway); delivery = (t_client_first, else t_first_out) - t_first_token and
    (t_client_last, else t_last_out) - t_last_token, regressed on (1, requests fed by that step: the step-trace
    line whose t_end is that token's time). Plain least squares on seconds, non-negative:
    the simulator needs the mean right (the tails come from the steps and the queue)."""
    import numpy as np

    outputs_at = {r.t_end: r.num_outputs for r in steps if r.t_end}

    def arrived_at(q):
        return q.get("t_send") if q.get("t_send") is not None else q.get("t_http")

    timed = sorted((q for q in requests if arrived_at(q) is not None and q.get("t_submit") is not None),
                   key=arrived_at)
    free, latest_submit = set(), -math.inf
    for q in timed:
        if latest_submit < arrived_at(q):
            free.add(id(q))
        latest_submit = max(latest_submit, q["t_submit"])
    use_free = len(free) >= 4
    adm_x, adm_y, del_x, del_y = [], [], [], []
    server_adm, client_adm, server_del, client_del = [], [], [], []
    for q in requests:
        if q.get("t_submit") is None or q.get("t_first_token") is None or q.get("t_first_out") is None:
            continue
        arrived = arrived_at(q)
        if arrived is not None and (id(q) in free or not use_free):
            adm_x.append((1.0, float(q["prompt_len"] or 0)))
            adm_y.append(q["t_submit"] - arrived)
            if q.get("t_http") is not None:
                server_adm.append(q["t_submit"] - q["t_http"])
                if q.get("t_send") is not None:
                    client_adm.append(q["t_http"] - q["t_send"])
        n_first = outputs_at.get(q["t_first_token"])
        first_seen = q.get("t_client_first") if q.get("t_client_first") is not None else q["t_first_out"]
        if n_first is not None:
            del_x.append((1.0, float(n_first)))
            del_y.append(first_seen - q["t_first_token"])
        server_del.append(q["t_first_out"] - q["t_first_token"])
        if q.get("t_client_first") is not None:
            client_del.append(q["t_client_first"] - q["t_first_out"])
        n_last = outputs_at.get(q.get("t_last_token"))
        last_seen = q.get("t_client_last") if q.get("t_client_last") is not None else q.get("t_last_out")
        if n_last is not None and last_seen is not None and q["t_last_token"] != q["t_first_token"]:
            del_x.append((1.0, float(n_last)))
            del_y.append(last_seen - q["t_last_token"])
    if len(adm_y) < 4 or len(del_y) < 4:
        raise ValueError(f"request_trace: need at least 4 streamed requests matched to the step trace, got "
                         f"{len(adm_y)} admissions and {len(del_y)} deliveries (was the trace written by "
                         f"`pagedserve serve --step-trace-path` with streaming requests?)")
    ax, ay, dx, dy = np.asarray(adm_x), np.asarray(adm_y), np.asarray(del_x), np.asarray(del_y)
    a = _nnls(ax, ay)
    d = _nnls(dx, dy)
    client = any(q.get("t_send") is not None for q in requests)
    overhead = ServingOverhead(float(a[0]), float(a[1]), float(d[0]), float(d[1]),
                               source=f"fitted on {len(adm_y)} requests"
                                      + (", client's send and receive times included" if client else
                                         ", server side only"))
    jitter = delivery_jitter(requests, steps, float(d[0]), float(d[1]))
    if jitter is not None:
        overhead.delivery_jitter_s, overhead.delivery_jitter_rho = jitter["quantiles_s"], jitter["rho"]

    def mean(v):
        return float(np.mean(v)) if v else None

    report = {
        "num_requests": len(requests), "num_admissions": len(adm_y), "num_deliveries": len(del_y),
        "admissions_from": "requests that found the serving layer free" if use_free else "all requests",
        "admission_residual_p99_s": float(np.percentile(ay - ax @ a, 99)),
        "delivery_residual_p99_s": float(np.percentile(dy - dx @ d, 99)),
        "admission_mean_s": mean(adm_y), "delivery_mean_s": mean(del_y),
        "server_admission_mean_s": mean(server_adm), "client_to_server_mean_s": mean(client_adm),
        "server_delivery_mean_s": mean(server_del), "server_to_client_mean_s": mean(client_del),
        "admission_p90_s": float(np.percentile(adm_y, 90)), "delivery_p90_s": float(np.percentile(del_y, 90)),
        "delivery_jitter": None if jitter is None else {k: v for k, v in jitter.items() if k != "quantiles_s"},
    }
    return overhead, report


MIN_JITTER_TOKENS = 200  # fewer paired tokens than this: no jitter is fitted


def delivery_jitter(requests: Sequence[dict], steps: Sequence[StepTrace], deliver_s: float,
                    deliver_per_output_s: float) -> dict | None:
    """How each token's arrival at the client scatters around the modelled delivery
    (deliver_s + deliver_per_output_s x the step's outputs after the step's end), from the streams
    whose tokens pair one to one with steps: every token in a chunk of its own (the client's
    chunks = its tokens) and the request in every step from its first token's to its last's (no
    preemption between: the steps in that span = its tokens). Returns the residuals' quantiles
    (scatter_quantiles) centred on 0 (the fitted delivery keeps the mean), their lag-1 correlation within a stream
    (a slow frame is often followed by another: the loop or the socket was busy for a while), and
    how many tokens and streams they came from; None without a client's per-chunk times or with
    fewer than MIN_JITTER_TOKENS paired tokens."""
    import numpy as np

    index = {r.t_end: i for i, r in enumerate(steps) if r.t_end}
    ends = np.array([r.t_end or 0.0 for r in steps])
    outputs = np.array([r.num_outputs for r in steps], dtype=float)
    streams = []
    for q in requests:
        itl, first = q.get("t_client_itl"), q.get("t_client_first")
        n = int(q.get("num_tokens") or 0)
        if itl is None or first is None or n < 2 or len(itl) + 1 != n or q.get("client_tokens") != n:
            continue  # no client times, or a chunk carried several tokens: arrivals and tokens do not pair
        i0, i1 = index.get(q.get("t_first_token")), index.get(q.get("t_last_token"))
        if i0 is None or i1 is None or i1 - i0 + 1 != n:
            continue  # preempted, or its steps are not all in the trace
        arrivals = first + np.concatenate([[0.0], np.cumsum(itl)])
        streams.append(arrivals - ends[i0:i1 + 1] - (deliver_s + deliver_per_output_s * outputs[i0:i1 + 1]))
    num_tokens = sum(len(x) for x in streams)
    if num_tokens < MIN_JITTER_TOKENS:
        return None
    mean = float(np.concatenate(streams).mean())
    centred = [x - mean for x in streams]
    rho = float(sum(float((x[1:] * x[:-1]).sum()) for x in centred) / max(sum(float((x * x).sum()) for x in centred),
                                                                         1e-30))
    pooled = np.concatenate(centred)
    quantiles = scatter_quantiles(pooled)
    p1, p99 = (float(v) for v in np.percentile(pooled, [1, 99]))
    return {"quantiles_s": quantiles, "rho": min(max(rho, 0.0), 0.99), "num_tokens": int(num_tokens),
            "num_streams": len(streams), "mean_offset_s": mean, "p1_s": p1, "p99_s": p99}
