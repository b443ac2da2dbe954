"""The serving overhead of a server without a request trace (vLLM), fitted self-consistently:
the calibration run replayed in the simulator, with the admission chosen so that the replay's
mean TTFT equals the client's.

Why not the subtraction (client TTFT minus the engine's queue + prefill time from /metrics,
reconstruct.serving_from_metrics): vLLM's queue time starts when its engine core takes the
request in, between two steps, so the wait for the step already running when a request arrives
is in neither its queue nor its prefill time; the subtraction leaves that wait in the admission,
and the simulator, whose queue does hold it, charges it a second time (vLLM's CPU server,
2026-12-02: replaying its calibration run gave a simulated queue of 8-10 ms against the
metric's 0.0, and a mean TTFT 14-32% above the client's). The replay prices the same run
with the same model the simulator will use, so whatever the model puts in queue and prefill is
not counted again. Only the calibration run is used: the held-out workloads never set it.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Callable

from pagedserve.bench.workloads import WorkloadRequest
from pagedserve.sim.host_overhead import ServingOverhead


def replay_workload(result: dict) -> list[WorkloadRequest]:
    """The requests a `pagedserve bench --result-file` run sent that succeeded: its send times
    (shifted to start at 0), prompt lengths and the tokens each received."""
    out = []
    for r in result.get("requests") or []:
        if r.get("success") and r.get("output_tokens"):
            out.append(WorkloadRequest(None, None, int(r["prompt_len"]), int(r["output_tokens"]),
                                       arrival_time=float(r["start"])))
    if not out:
        raise ValueError("bench_result: no successful request to replay")
    t0 = min(w.arrival_time for w in out)
    for w in out:
        w.arrival_time -= t0
    return sorted(out, key=lambda w: w.arrival_time)


@dataclass
class Replay:
    mean_ttft_s: float      # the client's view: admission + queue + prefill (+ delivery)
    mean_queue_s: float     # engine entry to first scheduled (the simulator's queue)
    mean_prefill_s: float   # first scheduled to the step that sampled the first token (vLLM's prefill time)


def replay(deployment, workload: list[WorkloadRequest], seed: int = 0) -> Replay:
    """Run `workload` through `deployment` and split its mean TTFT as vLLM's metrics do."""
    from pagedserve.sim.simulator import simulate

    queue, prefill = [], []

    def on_step(outs) -> None:
        for o in getattr(outs, "outputs", ()):
            if o.first_scheduled_time is not None:
                queue.append(o.first_scheduled_time - o.arrival_time)
                prefill.append(outs.timestamp - o.first_scheduled_time)

    res = simulate(deployment, workload, seed=seed, on_step=on_step)
    ttfts = [r.ttft for r in res.records if r is not None and r.ttft is not None]
    return Replay(statistics.mean(ttfts), statistics.mean(queue) if queue else 0.0,
                  statistics.mean(prefill) if prefill else 0.0)


def fit_admission(target_ttft_s: float, replay_at: Callable[[float], Replay], start_s: float = 0.0,
                  tol_s: float = 1e-4, max_iter: int = 12) -> tuple[float, Replay, list[tuple[float, float]]]:
    """The admission a >= 0 at which the replay's mean TTFT equals `target_ttft_s`.

    TTFT grows with a at slope >= 1 (a longer admission delays entry by a, and may move a
    request behind a step it used to precede), so a <- a + (target - TTFT(a)) converges from any
    start without overshooting much; it stops within `tol_s`, or at a = 0 when even no admission
    leaves the replay above the client (the model's queue + prefill exceed the measured TTFT).
    Returns (a, the replay at a, the (a, TTFT) iterates)."""
    a = max(start_s, 0.0)
    path: list[tuple[float, float]] = []
    for _ in range(max_iter):
        r = replay_at(a)
        path.append((a, r.mean_ttft_s))
        miss = target_ttft_s - r.mean_ttft_s
        if abs(miss) <= tol_s or (a == 0.0 and miss < 0):
            return a, r, path
        a = max(a + miss, 0.0)
    r = replay_at(a)
    path.append((a, r.mean_ttft_s))
    return a, r, path


def serving_by_replay(result: dict, params, build: Callable[[object], object],
                      engine_queue_s: float | None = None, engine_prefill_s: float | None = None,
                      seed: int = 0) -> tuple[ServingOverhead, dict]:
    """ServingOverhead(admit_s) for the fitted step costs `params` (CostParams) from the calibration
    run's bench `result`: `build(params)` makes the deployment to replay it on. The engine's own
    queue and prefill means (vLLM's /metrics), when given, are reported beside the replay's: a
    prefill far from the engine's says the step fit prices prompts wrong, which no admission fixes."""
    workload = replay_workload(result)
    ttfts = [float(r["ttft"]) for r in result["requests"] if r.get("success") and r.get("output_tokens")]
    target = statistics.mean(ttfts)

    def replay_at(a: float) -> Replay:
        p = replace(params, serving=ServingOverhead(admit_s=a, source="replay").to_dict())
        return replay(build(p), workload, seed)

    start = target - (engine_queue_s or 0.0) - (engine_prefill_s or 0.0) if engine_prefill_s is not None else 0.0
    zero = replay_at(0.0)
    admit, at, path = fit_admission(target, replay_at, start_s=max(start, 0.0))
    report = {"client_ttft_mean_s": target, "num_requests": len(workload), "admit_s": admit,
              "replay_ttft_mean_s": at.mean_ttft_s, "replay_queue_mean_s": at.mean_queue_s,
              "replay_prefill_mean_s": at.mean_prefill_s, "replay_ttft_without_admission_s": zero.mean_ttft_s,
              "engine_queue_mean_s": engine_queue_s, "engine_prefill_mean_s": engine_prefill_s,
              "iterations": [[x, y] for x, y in path]}
    report["warnings"] = replay_warnings(report)
    source = (f"replay of the calibration run: admission making its mean TTFT the client's "
              f"{target * 1e3:.1f} ms (simulated queue {at.mean_queue_s * 1e3:.1f} + prefill "
              f"{at.mean_prefill_s * 1e3:.1f} ms)")
    return ServingOverhead(admit_s=admit, source=source), report


def replay_warnings(report: dict, tolerance: float = 0.10) -> list[str]:
    """What the replay says about the step fit: its prefill far from the engine's own (no admission
    fixes that), or no admission at all left the replay above the client's TTFT."""
    out = []
    engine, replayed = report.get("engine_prefill_mean_s"), report.get("replay_prefill_mean_s")
    if engine and replayed is not None and abs(replayed / engine - 1) > tolerance:
        out.append(f"the replay's prefill time is {replayed / engine - 1:+.0%} off the engine's own "
                   f"({replayed * 1e3:.1f} against {engine * 1e3:.1f} ms from its /metrics): the step fit prices "
                   f"prompts {'high' if replayed > engine else 'low'}, and TTFT will be off by about that")
    if report.get("admit_s") == 0.0 and report.get("replay_ttft_mean_s", 0.0) > report.get("client_ttft_mean_s", 0.0):
        out.append(f"even with no admission the replay's mean TTFT ({report['replay_ttft_mean_s'] * 1e3:.1f} ms) "
                   f"exceeds the client's ({report['client_ttft_mean_s'] * 1e3:.1f} ms): admission set to 0")
    return out
