"""The pieces one simulated engine core runs with: the virtual clock, the deployment it is
built from (`build_core`: the engine's own EngineCore.build over a SimExecutor), the step
timeline and the result. sim/simulator.py runs one core on them, sim/data_parallel.py N
(below both, so neither imports the other)."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from pagedserve import metric_names as mn
from pagedserve.bench.workloads import WorkloadRequest
from pagedserve.config import EngineConfig
from pagedserve.core.engine_core import EngineCore, num_host_blocks_for
from pagedserve.plan.kv_budget import KVPoolSize
from pagedserve.sim.cost_model import CostModel, ServingOverhead
from pagedserve.sim.parallel_cost import ParallelCostModel
from pagedserve.sim.report import RequestRecord


class VirtualClock:
    """Seconds since the run started; the scheduler reads it through __call__."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@dataclass
class Deployment:
    """What the simulator needs to know about the deployment: the resolved engine config,
    the pool size in blocks (the engine's / planner's number), and the cost model."""

    config: EngineConfig
    num_blocks: int
    cost_model: CostModel | ParallelCostModel
    model_name: str
    vocab_size: int
    device: str                 # "cpu" or a GPU preset name
    tp: int = 1
    pool_note: str = ""
    bytes_per_block: int = 0    # one rank's bytes per KV block (sizes the host swap pool)
    layout: str = ""            # e.g. "TP4xPP2+EP4" (GPU deployments)
    plan: object = None         # the `pagedserve plan` that sized a GPU pool (plan.budget.Plan)
    dp: int = 1                 # -dp: engine cores, each this pool and cost model (sim/data_parallel.py)
    lockstep_cost: object = None  # DP attention + EP: the turn's price (parallel_cost.DPExpertParallelCost)

    @property
    def pool(self) -> KVPoolSize:
        """One rank's pool, as the engine core is built with it."""
        block_size = self.config.block_size
        return KVPoolSize(self.num_blocks, block_size, self.bytes_per_block // block_size)

    @property
    def num_host_blocks(self) -> int:
        """The host swap pool, as the engine sizes it: swap_space // bytes_per_block."""
        return num_host_blocks_for(self.config, self.pool)


def build_core(deployment: Deployment, executor, clock) -> EngineCore:
    """The engine's own core, built by the engine's own factory, on a virtual clock."""
    # host_memory: the simulated deployment's host is not this machine, so its free memory
    # says nothing about whether that host can hold a --kv-offloading-size tier.
    return EngineCore.build(deployment.config, executor, deployment.pool, clock=clock, cpu_clock=clock,
                            host_memory=1 << 62)


@dataclass
class Timeline:
    """One row per step (columns as lists: cheap to append, easy to plot)."""

    time: list[float] = field(default_factory=list)          # step end (s)
    num_running: list[int] = field(default_factory=list)
    num_waiting: list[int] = field(default_factory=list)
    num_swapped: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    num_batched_tokens: list[int] = field(default_factory=list)
    num_preempted: list[int] = field(default_factory=list)

    def to_dict(self, max_points: int = 2000) -> dict:
        n = len(self.time)
        stride = max(1, math.ceil(n / max_points))
        return {k: getattr(self, k)[::stride] for k in self.__dataclass_fields__}

    def as_scraped(self, max_points: int = 2000) -> dict[str, list[float]]:
        """The timeline in the shape `pagedserve bench` samples from /metrics (so its plots draw it)."""
        cumulative, total = [], 0
        for n in self.num_preempted:
            total += n
            cumulative.append(total)
        stride = max(1, math.ceil(len(self.time) / max_points))
        return {"t": self.time[::stride], mn.NUM_REQUESTS_RUNNING: self.num_running[::stride],
                mn.NUM_REQUESTS_WAITING: self.num_waiting[::stride], mn.NUM_REQUESTS_SWAPPED: self.num_swapped[::stride],
                mn.KV_CACHE_USAGE_PERC: self.kv_usage[::stride], mn.exposed(mn.NUM_PREEMPTIONS): cumulative[::stride]}


def host_tier_summary(scheduler, query_tokens: int) -> dict:
    """What the host tier did in a run, and what its loads cost by the core's own estimate
    (the cost rule that chose them: PreemptionCosts.load_seconds); {} without a tier."""
    tier = scheduler.kv.tier
    if tier is None:
        return {}
    c = tier.counters
    hit_tokens = c.hits * scheduler.kv.block_size
    costs = scheduler.costs
    load_s = costs.load_seconds(c.loaded) if costs is not None and costs.host_bandwidth else 0.0
    store_s = costs.load_seconds(c.stored) if costs is not None and costs.host_bandwidth else 0.0
    saved_s = costs.recompute_seconds(hit_tokens) if costs is not None else 0.0
    return {"capacity_blocks": tier.capacity, "used_blocks": tier.num_blocks, "query_tokens": query_tokens,
            "hit_tokens": hit_tokens, "hit_rate": hit_tokens / query_tokens if query_tokens else 0.0,
            "blocks_stored": c.stored, "blocks_loaded": c.loaded, "blocks_evicted": c.evicted,
            "load_seconds": load_s, "store_seconds": store_s, "recompute_seconds_saved": saved_s}


@dataclass
class SimResult:
    records: list[RequestRecord]
    metrics: dict
    timeline: Timeline
    num_steps: int
    num_blocks: int
    num_preemptions: int
    num_recomputed_tokens: int
    num_blocks_swapped_out: int
    num_blocks_swapped_in: int
    sim_wall_s: float
    busy_time: float
    preemptions_by_mode: dict = field(default_factory=dict)
    preemption_costs: object = None  # auto mode: what the core weighed at the end (PreemptionCosts)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    shapes: dict = field(default_factory=dict)   # the largest step shapes the run asked the cost model about
    serving: ServingOverhead = field(default_factory=ServingOverhead)
    # The host KV tier (--kv-offloading-size): its counters, hit rate and what loading cost ({} = none)
    host_tier: dict = field(default_factory=dict)
    # -dp: each core's requests, steps, KV usage, preemptions (sim/data_parallel.py), and the lockstep's turns
    per_core: list = field(default_factory=list)
    data_parallel: dict = field(default_factory=dict)

    def server_view(self) -> dict:
        """What `pagedserve bench` reads from a live server's /metrics during a run, from the
        simulated steps instead: so the simulated report has the same 'inside the server' part."""
        t = self.timeline
        view = {"num_samples": len(t.time)}
        for name, series in ((mn.KV_CACHE_USAGE_PERC, t.kv_usage), (mn.NUM_REQUESTS_RUNNING, t.num_running),
                             (mn.NUM_REQUESTS_WAITING, t.num_waiting), (mn.NUM_REQUESTS_SWAPPED, t.num_swapped)):
            if series:
                view[f"peak_{name}"] = max(series)
                view[f"mean_{name}"] = sum(series) / len(series)
        view[mn.exposed(mn.NUM_PREEMPTIONS)] = float(self.num_preemptions)
        view["preemptions_by_mode"] = {m: float(n) for m, n in self.preemptions_by_mode.items() if n}
        view[mn.exposed(mn.SWAPPED_BLOCKS)] = float(self.num_blocks_swapped_out + self.num_blocks_swapped_in)
        view[f"{mn.SWAPPED_BLOCKS}_by_direction"] = {"out": float(self.num_blocks_swapped_out),
                                               "in": float(self.num_blocks_swapped_in)}
        if self.prefix_cache_queries:
            view[mn.exposed(mn.PREFIX_CACHE_QUERIES)] = float(self.prefix_cache_queries)
            view[mn.exposed(mn.PREFIX_CACHE_HITS)] = float(self.prefix_cache_hits)
            view["prefix_cache_hit_rate"] = self.prefix_cache_hits / self.prefix_cache_queries
        if self.host_tier:
            view[mn.exposed(mn.EXTERNAL_PREFIX_CACHE_QUERIES)] = float(self.host_tier["query_tokens"])
            view[mn.exposed(mn.EXTERNAL_PREFIX_CACHE_HITS)] = float(self.host_tier["hit_tokens"])
        return view

    def to_dict(self, deployment: Deployment | None = None) -> dict:
        per_req = [r.num_preemptions for r in self.records]
        hist: dict[str, int] = {}
        for n in per_req:
            hist[str(n)] = hist.get(str(n), 0) + 1
        out = dict(self.metrics)
        out.update({
            "num_steps": self.num_steps,
            "num_kv_blocks": self.num_blocks,
            "num_recomputed_tokens": self.num_recomputed_tokens,
            "num_blocks_swapped_out": self.num_blocks_swapped_out,
            "num_blocks_swapped_in": self.num_blocks_swapped_in,
            "preemptions_per_request": hist,
            "max_kv_usage": max(self.timeline.kv_usage, default=0.0),
            "mean_kv_usage": (sum(self.timeline.kv_usage) / len(self.timeline.kv_usage)) if self.timeline.kv_usage else 0.0,
            "busy_fraction": self.busy_time / self.metrics["duration"] if self.metrics["duration"] else 0.0,
            "sim_wall_s": self.sim_wall_s,
            "serving_overhead": self.serving.to_dict(),
            "host_tier": self.host_tier,
            "step_shapes": self.shapes,
            "timeline": self.timeline.to_dict(),
        })
        if self.per_core:
            out.update(data_parallel=self.data_parallel, per_core=self.per_core)
        if deployment is not None:
            cfg = deployment.config
            out["deployment"] = {
                "model": deployment.model_name, "device": deployment.device, "tp": deployment.tp,
                "layout": deployment.layout,
                "num_kv_blocks": deployment.num_blocks, "pool": deployment.pool_note,
                "cost_params": deployment.cost_model.params.to_dict(),
                "engine_config": {k: getattr(cfg, k) for k in cfg.knob_names()},
            }
        return out


def _prompt_ids(w: WorkloadRequest, index: int, vocab_size: int, rng: random.Random | None) -> list[int]:
    if w.prompt_token_ids is not None:
        return list(w.prompt_token_ids)
    if rng is not None:  # prefix caching hashes the ids: make them realistic (random, unshared)
        return [rng.randrange(16, vocab_size) for _ in range(w.prompt_len)]
    return [16 + index % max(vocab_size - 16, 1)] * w.prompt_len  # content is never looked at


def deliver_token(rec: RequestRecord, seen: float, out) -> float:
    """One output reaching its client at `seen`, in order (a stream's token never overtakes the
    one before it): its token time, the first token's, and on a finish the end and preemptions.
    Returns when it was seen (the simulator, -dp's cores and the fleet all deliver this way)."""
    seen = max(seen, rec.token_times[-1]) if rec.token_times else seen
    if rec.first_token_time is None:
        rec.first_token_time = seen
    rec.token_times.append(seen)
    if out.finished:
        rec.finish, rec.num_preemptions = seen, out.num_preemptions
    return seen

