"""A fleet in the simulator: N copies of the real engine core behind the real router.

Each replica is `build_core` (the engine's own EngineCore) with its own SimExecutor and its own
virtual clock; the router is fleet/routing.py, the very policy code the Ray Serve application
runs, fed each replica's KV events in-process (the KVEventLog batches the ZMQ publisher would
ship) right after the step that made them, and its in-flight counts as requests start and end.

Discrete events: the next arrival is routed when no replica's step would end before it;
otherwise the replica whose clock is earliest steps. So a request is routed knowing exactly
what every replica held at its arrival (the real router learns it a network hop later).

The serving layer is charged per replica as simulate() charges it when not serial: the
admission cost before the request reaches its engine, the delivery cost after each step. The
router's own hop (the ingress and Ray's handle call) is not modelled.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Sequence

from pagedserve.bench.report import RequestRecord
from pagedserve.bench.workloads import WorkloadRequest
from pagedserve.core.request import Request
from pagedserve.fleet.routing import make_router
from pagedserve.sampling import SamplingParams
from pagedserve.sim.cost_model import ServingOverhead
from pagedserve.sim.executor import SimExecutor
from pagedserve.sim.report import compute_metrics
from pagedserve.sim.simulator import Deployment, VirtualClock, _prompt_ids, build_core, check_request_length


@dataclass
class FleetResult:
    records: list[RequestRecord]
    metrics: dict
    router: str
    num_replicas: int
    requests_per_replica: dict[str, int]
    decisions: dict[str, int]                 # reason -> requests
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    sim_wall_s: float = 0.0
    peak_kv_usage: dict[str, float] = field(default_factory=dict)
    policy: object = None                      # the router at the end (its view of each replica's cache)
    cores: dict = field(default_factory=dict)  # replica id -> its EngineCore (shut down)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def to_dict(self) -> dict:
        out = dict(self.metrics)
        out.update(router=self.router, replicas=self.num_replicas, requests_per_replica=self.requests_per_replica,
                   decisions=self.decisions, prefix_cache_queries=self.prefix_cache_queries,
                   prefix_cache_hits=self.prefix_cache_hits, prefix_cache_hit_rate=self.prefix_hit_rate,
                   num_steps=self.num_steps, num_preemptions=self.num_preemptions, sim_wall_s=self.sim_wall_s,
                   peak_kv_usage=self.peak_kv_usage)
        return out


class _Replica:
    def __init__(self, replica_id: str, deployment: Deployment, seed: int) -> None:
        self.replica_id = replica_id
        self.clock = VirtualClock()
        executor = SimExecutor(deployment.cost_model, deployment.vocab_size, seed, clock=self.clock)
        self.core = build_core(deployment, executor, self.clock)
        self.core.record_kv_events()
        self.live: dict[str, RequestRecord] = {}
        self.num_requests = 0
        self.peak_kv_usage = 0.0


def simulate_fleet(deployment: Deployment, workload: Sequence[WorkloadRequest], replicas: int, router: str, *,
                   seed: int = 0, goodput_slos: dict[str, float] | None = None,
                   router_kwargs: dict | None = None) -> FleetResult:
    """Open loop: each request arrives at its arrival_time and is routed then."""
    if replicas < 1:
        raise ValueError(f"replicas: must be >= 1, got {replicas}")
    wall0 = time.perf_counter()
    config = deployment.config
    fleet = [_Replica(f"replica-{i}", deployment, seed + i) for i in range(replicas)]
    by_id = {r.replica_id: r for r in fleet}
    policy = make_router(router, config.block_size, seed, **(router_kwargs or {}))
    policy.set_replicas(by_id)
    serving = ServingOverhead.from_dict(deployment.cost_model.params.serving)
    id_rng = random.Random(seed) if config.enable_prefix_caching else None
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_time)
    records: list[RequestRecord] = []
    decisions: dict[str, int] = {}
    owner: dict[str, _Replica] = {}
    steps = preemptions = 0
    next_idx = 0

    def busy() -> list[_Replica]:
        return [r for r in fleet if r.core.has_unfinished_requests()]

    while True:
        stepping = busy()
        next_step_at = min((r.clock.now for r in stepping), default=None)
        if next_idx < len(order) and (next_step_at is None or workload[order[next_idx]].arrival_time <= next_step_at):
            i = order[next_idx]
            next_idx += 1
            w = workload[i]
            rec = RequestRecord(str(i), w.arrival_time, w.prompt_len, w.output_len)
            records.append(rec)
            try:
                check_request_length(w.prompt_len, w.output_len, config.max_model_len)
            except ValueError as e:
                rec.failed, rec.error = True, str(e)
                continue
            ids = _prompt_ids(w, i, deployment.vocab_size, id_rng)
            for r in fleet:
                sched = r.core.scheduler
                policy.report_load(r.replica_id, len(sched.waiting), len(sched.running), sched.kv.usage)
            decision = policy.choose(ids)
            decisions[decision.reason] = decisions.get(decision.reason, 0) + 1
            target = by_id[decision.replica_id]
            policy.started(target.replica_id)
            entry = w.arrival_time + serving.admit(w.prompt_len)
            if not target.core.has_unfinished_requests():
                target.clock.now = max(target.clock.now, entry)
            params = SamplingParams(max_tokens=w.output_len, ignore_eos=True)
            target.core.add_request(Request(rec.request_id, ids, params, frozenset(), entry, 0, config.max_model_len))
            target.live[rec.request_id] = rec
            target.num_requests += 1
            owner[rec.request_id] = target
            continue
        if next_step_at is None:
            break
        replica = min(stepping, key=lambda r: r.clock.now)
        outs = replica.core.step()
        steps += 1
        st = outs.stats
        preemptions += sum(st.num_preempted.values())
        replica.peak_kv_usage = max(replica.peak_kv_usage, st.kv_usage)
        policy.apply_events(replica.replica_id, replica.core.take_kv_events())
        if not st.num_batched_tokens and not st.num_blocks_swapped_out and not st.num_blocks_swapped_in:
            # Nothing could run on this replica: only an arrival can change that.
            if next_idx < len(order):
                replica.clock.now = max(replica.clock.now, workload[order[next_idx]].arrival_time)
                continue
            raise RuntimeError(f"fleet simulation stuck on {replica.replica_id} at t={replica.clock.now:.3f}s")
        seen_at = outs.timestamp + (serving.deliver(len(outs.outputs)) if outs.outputs and not serving.is_zero else 0.0)
        for out in outs.outputs:
            rec = replica.live[out.request_id]
            seen = max(seen_at, rec.token_times[-1]) if rec.token_times else seen_at
            if rec.first_token_time is None:
                rec.first_token_time = seen
            rec.token_times.append(seen)
            if out.finished:
                replica.live.pop(out.request_id)
                rec.finish = seen
                rec.num_preemptions = out.num_preemptions
                policy.finished(replica.replica_id)
    for r in fleet:
        r.core.shutdown()
    duration = max((r.finish for r in records if r.finish is not None), default=0.0)
    metrics = compute_metrics(records, duration, goodput_slos=goodput_slos)
    return FleetResult(records, metrics, router, replicas, {r.replica_id: r.num_requests for r in fleet}, decisions,
                       sum(r.core.scheduler.kv.prefix_queries for r in fleet),
                       sum(r.core.scheduler.kv.prefix_hits for r in fleet), steps, preemptions,
                       time.perf_counter() - wall0, {r.replica_id: r.peak_kv_usage for r in fleet}, policy,
                       {r.replica_id: r.core for r in fleet})


def shared_prefix_workload(num_tenants: int, prefix_len: int, suffix_len: int, output_len: int,
                           num_requests: int, request_rate: float, vocab_size: int, seed: int = 0
                           ) -> list[WorkloadRequest]:
    """Multi-tenant traffic: each request is one of `num_tenants` distinct long prefixes (a system
    prompt, a document) plus a short unique suffix, tenants drawn uniformly, Poisson arrivals."""
    from pagedserve.bench.workloads import arrival_times

    rng = random.Random(seed)
    prefixes = [[rng.randrange(16, vocab_size) for _ in range(prefix_len)] for _ in range(num_tenants)]
    out = []
    for t in arrival_times(num_requests, request_rate, seed=seed):
        tenant = rng.randrange(num_tenants)
        ids = prefixes[tenant] + [rng.randrange(16, vocab_size) for _ in range(suffix_len)]
        out.append(WorkloadRequest(ids, None, len(ids), output_len, arrival_time=t, tags={"tenant": tenant}))
    return out
