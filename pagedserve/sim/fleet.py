"""A fleet in the simulator: N copies of the real engine core behind the real router.

Each replica is `build_core` (the engine's own EngineCore) with its own SimExecutor and its own
virtual clock; the router is fleet/routing.py, the very policy code the Ray Serve application
runs, fed each replica's KV events in-process (the KVEventLog batches the ZMQ publisher would
ship) right after the step that made them, and its in-flight counts as requests start and end.

Discrete events: the next arrival is routed when no replica's step would end before it;
otherwise the replica whose clock is earliest steps. So a request is routed knowing exactly
what every replica held at its arrival (the real router learns it a network hop later).

Around each replica, what a request crosses (each term measured, never fitted to a fleet run):

* the fleet's hop (`FleetHop`, measured by sim/fleet_probe.py): client -> Ray Serve's proxy ->
  the ingress -> the router -> the handle call -> the replica's loopback HTTP before its server
  sees the request (``request_s + per_prompt_token_s x prompt``), and every streamed chunk's way
  back (``chunk_s``), both as one request alone sees them. The proxy and the ingress are one
  process each for the whole fleet, two stages in a row: their CPU per request and per chunk
  queues there (a chunk waits for the ones before it at each stage), which adds to those latencies
  once many streams share them;
* the replica's own end of each stream (``replica_cpu_per_chunk_s``: its SSE frame read back by
  the replica's loopback client and handed to Ray's streaming generator): in the replica's
  process, under one interpreter lock with its engine thread, so each step's chunks hold the
  engine back by that much before its next step;
* the replica's serving layer (ServingOverhead, the deployment's `serving` terms, as simulate()
  charges them): admission before the request reaches its engine, delivery after each step; one
  event loop per replica when `serial`;
* the core a replica's engine thread gets (``step_scale``): the probe's step wall / CPU time over
  the calibration run's, every step's duration times that (`contention_scale`).

A request is routed at its arrival (the router runs in the ingress, a few hundred microseconds
after the proxy takes it; not modelled apart) and reaches its replica's engine when the hop and
the admission are done: the engine schedules it from then on, not before.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Sequence

from pagedserve.bench.report import RequestRecord
from pagedserve.bench.workloads import WorkloadRequest
from pagedserve.core.engine_core import check_request_length
from pagedserve.core.request import Request
from pagedserve.fleet.routing import make_router
from pagedserve.sampling import SamplingParams
from pagedserve.sim.core_run import deliver_token
from pagedserve.sim.cost_model import ServingOverhead
from pagedserve.sim.executor import SimExecutor
from pagedserve.sim.report import compute_metrics
from pagedserve.sim.serving_loop import HeapSends, ServingLoop
from pagedserve.sim.simulator import Deployment, VirtualClock, _prompt_ids, build_core


FLEET_OVERHEAD_PATH = Path(__file__).with_name("fleet_overhead.json")


@dataclass(frozen=True)
class FleetHop:
    """What the fleet's own path adds around each replica's server (module docstring)."""

    request_s: float = 0.0            # inbound: client -> proxy -> ingress -> router -> replica's HTTP
    per_prompt_token_s: float = 0.0   # ... growing with the body (the prompt's ids as JSON, parsed thrice)
    chunk_s: float = 0.0              # outbound, per streamed chunk: replica's HTTP -> ingress -> proxy -> client
    proxy_cpu_per_request_s: float = 0.0     # Ray Serve's proxy: one process, its CPU queues
    proxy_cpu_per_chunk_s: float = 0.0
    ingress_cpu_per_request_s: float = 0.0   # the ingress (and the router in it): one process
    ingress_cpu_per_chunk_s: float = 0.0
    replica_cpu_per_chunk_s: float = 0.0     # the replica's end of a stream, one lock with its engine
    # A replica's step takes step_scale x the cost model's: the engine thread's share of a core
    # inside the fleet against the share it had when the cost model was calibrated (both
    # measured: contention_scale). 1: as calibrated.
    step_scale: float = 1.0
    source: str = "none"

    def inbound(self, prompt_len: int) -> float:
        return self.request_s + self.per_prompt_token_s * prompt_len

    @property
    def is_zero(self) -> bool:
        return self.step_scale == 1.0 and not any(getattr(self, f.name) for f in fields(self)
                                                   if f.name not in ("source", "step_scale"))

    def describe(self) -> str:
        if self.is_zero:
            return "fleet hop: none modelled"
        return (f"fleet hop: {self.request_s * 1e3:.1f} ms + {self.per_prompt_token_s * 1e6:.2f} us/prompt token in, "
                f"{self.chunk_s * 1e3:.1f} ms per chunk out; CPU per request / chunk: proxy "
                f"{self.proxy_cpu_per_request_s * 1e3:.1f} / {self.proxy_cpu_per_chunk_s * 1e3:.2f} ms, ingress "
                f"{self.ingress_cpu_per_request_s * 1e3:.1f} / {self.ingress_cpu_per_chunk_s * 1e3:.2f} ms, replica "
                f"- / {self.replica_cpu_per_chunk_s * 1e3:.2f} ms; steps x{self.step_scale:.2f} ({self.source})")

    @classmethod
    def from_dict(cls, d: dict | None) -> "FleetHop":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)


class _Stages:
    """Processes that each serve one thing at a time (the proxy, the ingress), passed in a given
    order: `wait(t, [(stage, cost), ...])` is how long something that reaches the first at `t`
    waits in them in all, beyond its own service there (its queueing)."""

    def __init__(self) -> None:
        self.free_at: dict[str, float] = {}

    def wait(self, t: float, path: Sequence[tuple[str, float]]) -> float:
        done = t
        for stage, cost in path:
            done = max(done, self.free_at.get(stage, 0.0)) + cost
            self.free_at[stage] = done
        return done - t - sum(cost for _, cost in path)


def load_fleet_overhead(path: str | Path = FLEET_OVERHEAD_PATH) -> dict:
    """The probe's fit (sim/fleet_probe.py --out): the hop's terms and the replica's serving layer's."""
    data = json.loads(Path(path).read_text())
    return data.get("fit", data)


def default_fleet_hop(path: str | Path | None = None, engine_thread: bool = True) -> FleetHop:
    """The shipped probe's hop (fleet_overhead.json), or that of a probe run on the host (`path`).
    `engine_thread` False: the replica's engine core runs in its own process (`serve`'s default
    on CUDA), so the replica's end of the streams holds no lock the engine needs."""
    p = Path(path) if path is not None else FLEET_OVERHEAD_PATH
    hop = FleetHop.from_dict(load_fleet_overhead(p)) if p.is_file() else FleetHop()
    return hop if engine_thread else replace(hop, replica_cpu_per_chunk_s=0.0)


def contention_scale(probe_fit: dict, calibration_trace: str | Path) -> float:
    """FleetHop.step_scale: a calibrated cost model holds the wall-clock stretch its own run had
    (its steps' median wall / CPU time: 1 with a core to itself, 2 with half of one); a replica in
    the fleet gets the stretch the fleet probe measured on its steps. The ratio of the two."""
    from pagedserve.sim.calibration import read_trace
    from pagedserve.sim.fleet_probe import step_stretch

    return probe_fit.get("replica_step_stretch", 1.0) / step_stretch(read_trace(calibration_trace))


def probe_serving(path: str | Path | None = None) -> ServingOverhead:
    """A replica's serving layer as the fleet probe measured it (one request at a time: service
    times, so one event loop per replica, `serial`)."""
    fit = load_fleet_overhead(path if path is not None else FLEET_OVERHEAD_PATH)
    return ServingOverhead(fit.get("admit_s", 0.0), fit.get("admit_per_prompt_token_s", 0.0), fit.get("deliver_s", 0.0),
                           0.0, source=fit.get("source", "fleet_probe"), serial=True)


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
    def __init__(self, replica_id: str, deployment: Deployment, seed: int, serving: ServingOverhead) -> None:
        self.replica_id = replica_id
        self.clock = VirtualClock()
        executor = SimExecutor(deployment.cost_model, deployment.vocab_size, seed, clock=self.clock)
        self.core = build_core(deployment, executor, self.clock)
        self.core.record_kv_events()
        self.live: dict[str, RequestRecord] = {}
        # Its serving layer (the simulator's own, sim/serving_loop.py): requests routed to it reach
        # its server after the hop (`sends`), then its loop admits them.
        self.loop = ServingLoop(serving, seed)
        self.max_model_len = deployment.config.max_model_len
        self.sends = HeapSends()
        self.requests: dict[int, tuple] = {}   # workload index -> (id, prompt ids, params): not in the engine yet
        self.num_requests = 0
        self.peak_kv_usage = 0.0

    def next_event(self) -> float | None:
        """When this replica next does something: its next step, else the next request's entry."""
        if self.core.has_unfinished_requests():
            return self.clock.now
        if self.loop.busy() or len(self.sends):
            return self.loop.next_entry(self.sends, self.clock.now)
        return None

    def take_arrived(self) -> None:
        """Requests whose hop and admission are done reach the engine (an idle one waits for them)."""
        if not self.core.has_unfinished_requests() and (self.loop.busy() or len(self.sends)):
            self.clock.now = max(self.clock.now, self.loop.next_entry(self.sends, self.clock.now))
        self.loop.admit(self.sends, self.clock.now)
        for entry, i in self.loop.entered(self.clock.now):
            request_id, ids, params = self.requests.pop(i)
            self.core.add_request(Request(request_id, ids, params, frozenset(), entry, 0, self.max_model_len))


def simulate_fleet(deployment: Deployment, workload: Sequence[WorkloadRequest], replicas: int, router: str, *,
                   seed: int = 0, goodput_slos: dict[str, float] | None = None,
                   router_kwargs: dict | None = None, hop: FleetHop | None = None,
                   serving: ServingOverhead | None = None) -> FleetResult:
    """Open loop: each request arrives at its arrival_time and is routed then. `hop`: the fleet's
    path around the replicas (default none: FleetHop(); `default_fleet_hop()` is the shipped
    probe's); `serving`: each replica's serving layer (default the deployment's cost model's)."""
    if replicas < 1:
        raise ValueError(f"replicas: must be >= 1, got {replicas}")
    wall0 = time.perf_counter()
    config = deployment.config
    if serving is None:
        serving = ServingOverhead.from_dict(deployment.cost_model.params.serving)
    fleet = [_Replica(f"replica-{i}", deployment, seed + i, serving) for i in range(replicas)]
    by_id = {r.replica_id: r for r in fleet}
    policy = make_router(router, config.block_size, seed, **(router_kwargs or {}))
    policy.set_replicas(by_id)
    hop = hop or FleetHop()
    # The proxy and the ingress, one process each for the fleet: requests pass proxy then ingress,
    # chunks ingress then proxy (each process one queue, whichever way its work goes).
    stages = _Stages()
    in_costs = (("proxy", hop.proxy_cpu_per_request_s), ("ingress", hop.ingress_cpu_per_request_s))
    out_costs = (("ingress", hop.ingress_cpu_per_chunk_s), ("proxy", hop.proxy_cpu_per_chunk_s))
    queued = any(c for _, c in in_costs + out_costs)
    id_rng = random.Random(seed) if config.enable_prefix_caching else None
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_time)
    records: list[RequestRecord] = []
    decisions: dict[str, int] = {}
    steps = preemptions = 0
    next_idx = 0

    def route() -> None:
        """The next arrival, routed at its arrival: on its way to its replica's server."""
        nonlocal next_idx
        i = order[next_idx]
        next_idx += 1
        w = workload[i]
        rec = RequestRecord(str(i), w.arrival_time, w.prompt_len, w.output_len)
        records.append(rec)
        try:
            check_request_length(w.prompt_len, w.output_len, config.max_model_len)
        except ValueError as e:
            rec.failed, rec.error = True, str(e)
            return
        ids = _prompt_ids(w, i, deployment.vocab_size, id_rng)
        for r in fleet:
            sched = r.core.scheduler
            policy.report_load(r.replica_id, len(sched.waiting) + len(r.requests), len(sched.running),
                               sched.kv.usage)
        decision = policy.choose(ids)
        decisions[decision.reason] = decisions.get(decision.reason, 0) + 1
        target = by_id[decision.replica_id]
        policy.started(target.replica_id)
        at_replica = w.arrival_time + hop.inbound(w.prompt_len)
        if queued:
            at_replica += stages.wait(w.arrival_time, in_costs)
        params = SamplingParams(max_tokens=w.output_len, ignore_eos=True)
        # It reaches the replica's server after the hop; its arrival in the engine is its entry.
        target.requests[i] = (rec.request_id, ids, params)
        target.sends.push(at_replica, i, w.prompt_len)
        target.live[rec.request_id] = rec
        target.num_requests += 1

    while True:
        events = [(t, r) for r in fleet if (t := r.next_event()) is not None]
        next_at = min((t for t, _ in events), default=None)
        if next_idx < len(order) and (next_at is None or workload[order[next_idx]].arrival_time <= next_at):
            route()
            continue
        if next_at is None:
            break
        replica = min((r for t, r in events if t == next_at), key=lambda r: r.replica_id)
        replica.take_arrived()
        if not replica.core.has_unfinished_requests():
            continue   # its next request is still in its serving layer (next_event says until when)
        outs = replica.core.step()
        if hop.step_scale != 1.0 and outs.execute_time:
            replica.clock.now += (hop.step_scale - 1.0) * outs.execute_time   # the step ends later
            outs.timestamp = replica.clock.now
        steps += 1
        st = outs.stats
        preemptions += sum(st.num_preempted.values())
        replica.peak_kv_usage = max(replica.peak_kv_usage, st.kv_usage)
        policy.apply_events(replica.replica_id, replica.core.take_kv_events())
        if not st.num_batched_tokens and not st.num_blocks_swapped_out and not st.num_blocks_swapped_in:
            # Nothing could run on this replica: only an arrival (routed, or reaching it) can change that.
            upcoming = [t for t in ((workload[order[next_idx]].arrival_time if next_idx < len(order) else None),
                                    replica.loop.next_entry(replica.sends, replica.clock.now)
                                    if replica.loop.busy() or len(replica.sends) else None) if t is not None]
            if upcoming:
                replica.clock.now = max(replica.clock.now, min(upcoming))
                continue
            raise RuntimeError(f"fleet simulation stuck on {replica.replica_id} at t={replica.clock.now:.3f}s")
        if not outs.outputs:
            continue
        # Requests that arrived while the step ran reach the loop before its delivery work (the
        # single engine's order), so route them first: those that come before every other
        # replica's next event (routing any later would pass over that event).
        others = min((t for r in fleet if r is not replica and (t := r.next_event()) is not None), default=math.inf)
        while next_idx < len(order) and workload[order[next_idx]].arrival_time <= min(outs.timestamp, others):
            route()
            others = min((t for r in fleet if r is not replica and (t := r.next_event()) is not None),
                         default=math.inf)
        seen_at = replica.loop.deliver(replica.sends, outs.timestamp, len(outs.outputs))
        if hop.replica_cpu_per_chunk_s:
            # The replica's end of the streams, under the engine's interpreter lock: its next step
            # waits for it. (A lone chunk's latency, chunk_s, already holds it.)
            replica.clock.now += hop.replica_cpu_per_chunk_s * len(outs.outputs)
        for out in outs.outputs:
            rec = replica.live[out.request_id]
            seen = replica.loop.seen_at(out.request_id, seen_at, outs.timestamp, out.finished)
            deliver_token(rec, seen + hop.chunk_s + (stages.wait(seen_at, out_costs) if queued else 0.0), out)
            if out.finished:
                replica.live.pop(out.request_id)
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
