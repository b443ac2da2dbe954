"""`pagedserve tune`: sweep knobs on the simulator, keep the Pareto front, pick the sweet spot.

The source articles' method, automated: push `max_num_seqs` (and friends) toward the edge,
watch throughput, P99 latency and preemptions, and back off to the balance point — high
utilisation, P99 within the SLO, no frequent preemption. Each point is one simulated run of
the same workload through the real scheduler.

Pure over its inputs: `run_point` is given as a function, so the same sweep runs on the
simulator or (with --real) on the real engine.
"""
from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

from pagedserve.config import KV_CACHE_DTYPES, EngineConfig


def _one_of(choices: tuple[str, ...]):
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"{text!r} is not one of {choices}")
        return text
    return parse


SWEEPABLE = {
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "enable_chunked_prefill": lambda s: {"true": True, "on": True, "1": True,
                                         "false": False, "off": False, "0": False}[s.lower()],
    "gpu_memory_utilization": float,
    "preemption_mode": str,
    "long_prefill_token_threshold": int,
    "block_size": int,
    # fp8 / int8 hold about twice the tokens of a bf16 pool (4x fp32): the lever when memory binds.
    "kv_cache_dtype": _one_of(KV_CACHE_DTYPES),
}


def parse_sweep(specs: Iterable[str]) -> dict[str, list]:
    """['max_num_seqs=16,32', 'enable_chunked_prefill=on,off'] -> {knob: [values]}."""
    grid: dict[str, list] = {}
    for spec in specs:
        if "=" not in spec:
            raise ValueError(f"sweep: expected KNOB=V1,V2,..., got {spec!r}")
        knob, values = spec.split("=", 1)
        knob = knob.strip().replace("-", "_")
        if knob not in SWEEPABLE:
            raise ValueError(f"sweep: {knob!r} cannot be swept; choose from {sorted(SWEEPABLE)}")
        try:
            grid[knob] = [SWEEPABLE[knob](v.strip()) for v in values.split(",") if v.strip()]
        except (ValueError, KeyError):
            raise ValueError(f"sweep: bad value in {spec!r}") from None
        if not grid[knob]:
            raise ValueError(f"sweep: no values in {spec!r}")
    return grid


FLEET_ROUTERS = ("round-robin", "power-of-two", "kv-aware")


def parse_fleet(replicas: str | None, routers: str | None) -> dict[str, list]:
    """'1,2,4' and 'kv-aware,round-robin' -> {'replicas': [1, 2, 4], 'router': [...]}; {} without replicas."""
    if replicas is None:
        if routers is not None:
            raise ValueError("router: give --replicas N1,N2 too (the routers share a fleet's requests)")
        return {}
    try:
        counts = sorted({int(v) for v in str(replicas).split(",") if v.strip()})
    except ValueError:
        raise ValueError(f"replicas: expected counts like 1,2,4, got {replicas!r}") from None
    if not counts or counts[0] < 1:
        raise ValueError(f"replicas: expected counts >= 1 like 1,2,4, got {replicas!r}")
    names = [r.strip() for r in (routers or "kv-aware").split(",") if r.strip()]
    for name in names:
        if name not in FLEET_ROUTERS:
            raise ValueError(f"router: {name!r} is not one of {FLEET_ROUTERS}")
    if not names:
        raise ValueError(f"router: no router in {routers!r}")
    return {"replicas": counts, "router": list(dict.fromkeys(names))}


def gpus_of(knobs: dict) -> int:
    """GPUs a point takes: replicas x the layout's (1 where neither is swept)."""
    per = 1
    if knobs.get("layout"):
        from pagedserve.plan.parallel import parse_layout
        per = parse_layout(knobs["layout"]).num_gpus
    return knobs.get("replicas", 1) * per


def parse_slos(specs: Iterable[str] | None) -> dict[str, float]:
    """['ttft_p99:2000', 'itl_p99:100'] -> {'ttft_p99': 2000.0, 'itl_p99': 100.0} (ms)."""
    allowed = ("ttft_p99", "itl_p99", "tpot_p99", "e2el_p99")
    out = {}
    for spec in specs or []:
        key, _, value = spec.partition(":")
        if key not in allowed:
            raise ValueError(f"slo: {key!r} is not one of {allowed}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"slo: {spec!r} needs a number of milliseconds, e.g. ttft_p99:2000") from None
        if out[key] <= 0:
            raise ValueError(f"slo: {spec!r} must be > 0 ms")
    return out


def expand_grid(grid: dict[str, list], max_num_seqs_bound: int | None = None,
                max_model_len: int | None = None) -> tuple[list[dict], list[str]]:
    """All combinations, minus the ones that cannot be right: max_num_seqs far past what
    the pool holds at the workload's mean length (preemption is then certain). Without
    chunked prefill a whole prompt must fit one step, so there max_num_batched_tokens is
    raised to max_model_len (as the engine requires) and duplicates are dropped."""
    keys = list(grid)
    points, pruned, seen = [], [], set()
    for combo in itertools.product(*(grid[k] for k in keys)):
        point = dict(zip(keys, combo))
        if point.get("enable_chunked_prefill") is False and max_model_len and "max_num_batched_tokens" in point:
            point["max_num_batched_tokens"] = max(point["max_num_batched_tokens"], max_model_len)
        key = tuple(sorted(point.items()))
        if key in seen:
            continue
        seen.add(key)
        seqs = point.get("max_num_seqs")
        if max_num_seqs_bound is not None and seqs is not None and seqs > 1.25 * max_num_seqs_bound:
            pruned.append(f"{point}: max_num_seqs {seqs} > 1.25 x the {max_num_seqs_bound} sequences the pool "
                          f"holds at the mean length")
            continue
        points.append(point)
    return points, pruned


@dataclass
class PointResult:
    knobs: dict
    output_throughput: float
    request_throughput: float
    p99_ttft_ms: float
    p99_itl_ms: float
    p99_tpot_ms: float
    p99_e2el_ms: float
    preemptions_per_request: float
    busy_fraction: float
    failed: int = 0
    error: str = ""
    meets_slo: bool = False
    on_front: bool = False
    tail: float = math.inf   # the latency axis of the front (see tail_score)
    extra: dict = field(default_factory=dict)


def point_from_metrics(knobs: dict, metrics: dict, num_requests: int, busy_fraction: float = float("nan")) -> PointResult:
    n = max(num_requests, 1)
    return PointResult(knobs, metrics["output_throughput"], metrics["request_throughput"],
                       metrics.get("p99_ttft_ms", math.nan), metrics.get("p99_itl_ms", math.nan),
                       metrics.get("p99_tpot_ms", math.nan), metrics.get("p99_e2el_ms", math.nan),
                       metrics.get("num_preemptions", 0) / n, busy_fraction, metrics.get("failed", 0))


def tail_score(p: PointResult, slos: dict[str, float]) -> float:
    """The latency axis: with SLOs, the worst P99 as a multiple of its SLO (<= 1 meets all);
    without, P99 ITL in ms."""
    if not slos:
        return p.p99_itl_ms
    values = {"ttft_p99": p.p99_ttft_ms, "itl_p99": p.p99_itl_ms, "tpot_p99": p.p99_tpot_ms,
              "e2el_p99": p.p99_e2el_ms}
    return max(values[k] / v for k, v in slos.items())


def mark_front(points: list[PointResult]) -> None:
    """Pareto front of (throughput up, tail down) among points that ran."""
    ok = [p for p in points if not p.error]
    for p in ok:
        p.on_front = not any(
            q is not p and q.output_throughput >= p.output_throughput and q.tail <= p.tail
            and (q.output_throughput > p.output_throughput or q.tail < p.tail) for q in ok)


def choose_sweet_spot(points: list[PointResult], slos: dict[str, float], max_preemption_rate: float,
                      tie_tolerance: float = 0.02) -> tuple[PointResult | None, str]:
    """The articles' balance point: every SLO met, no failed request, preemptions within the
    limit; of those the highest throughput (= highest utilisation). Throughputs within
    `tie_tolerance` count as equal: then the lower tail wins, then fewer max_num_seqs
    (less memory at stake)."""
    for p in points:
        p.meets_slo = (not p.error and p.failed == 0 and p.tail <= 1.0 if slos else not p.error and p.failed == 0)
    feasible = [p for p in points if p.meets_slo and p.preemptions_per_request <= max_preemption_rate]
    if not feasible:
        return None, "no point meets the SLOs and the preemption limit; relax them or add capacity"
    fleet = any("replicas" in p.knobs for p in feasible)
    if fleet:
        # Sizing a fleet: at a given arrival rate more replicas only buy headroom; the answer is
        # the fewest GPUs that meet the SLOs, and among those the usual balance point.
        fewest = min(gpus_of(p.knobs) for p in feasible)
        feasible = [p for p in feasible if gpus_of(p.knobs) == fewest]
    best = max(p.output_throughput for p in feasible)
    near = [p for p in feasible if p.output_throughput >= (1 - tie_tolerance) * best]
    chosen = min(near, key=lambda p: (p.tail, p.knobs.get("max_num_seqs") or 0))
    why = (f"highest throughput ({chosen.output_throughput:.1f} tok/s) among {len(feasible)} of {len(points)} points "
           f"meeting the SLOs with <= {max_preemption_rate:g} preemptions per request")
    if fleet:
        why = f"the fewest GPUs ({gpus_of(chosen.knobs)}) meeting the SLOs; " + why
    return chosen, why


# knobs that shape the deployment (sim.cli.deployment_layout), not the engine's config
DEPLOYMENT_KNOBS = ("layout", "replicas", "router")


def apply_knobs(base: EngineConfig, knobs: dict) -> EngineConfig:
    config = copy.deepcopy(base)
    for k, v in knobs.items():
        if k not in DEPLOYMENT_KNOBS:
            setattr(config, k, v)
    config.validate()
    return config


def sweep(base: EngineConfig, points: list[dict], run_point: Callable[[EngineConfig, dict], PointResult],
          slos: dict[str, float], on_point: Callable[[PointResult], None] | None = None) -> list[PointResult]:
    results = []
    for knobs in points:
        try:
            result = run_point(apply_knobs(base, knobs), knobs)
        except ValueError as e:  # a combination the engine refuses (e.g. pool too small)
            result = PointResult(knobs, 0.0, 0.0, *([math.nan] * 4), 0.0, math.nan, error=str(e))
        result.tail = tail_score(result, slos) if not result.error else math.inf
        results.append(result)
        if on_point:
            on_point(result)
    mark_front(results)
    return results


def knob_flags(knobs: dict) -> str:
    parts = []
    for k, v in knobs.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            parts.append(flag if v else "--no-" + flag[2:])
        else:
            parts.append(f"{flag} {v}")
    return " ".join(parts)
