"""EngineCore: one step of the engine, torch-free.

    step():  scheduler.schedule()            who runs, how many tokens, who is preempted
             executor.execute(out)           the model (or the simulator's cost model)
             scheduler.update_from_output()  advance, append tokens, token stop rules
             -> EngineCoreOutputs            per-request deltas + this step's stats

The real engine and the simulator drive this same object, built by the same factory
(`EngineCore.build`): the same scheduler, the same preemption cost estimate and its updates,
so for the same arrivals and step times they make the same decisions. The front-ends
(engine.Engine, engine.AsyncLLM) add tokenization, detokenization, stop strings and
parallel-sample groups around it; the core knows nothing of text.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterable

from pagedserve.config import EngineConfig, PreemptionMode
from pagedserve.core.executor import Executor
from pagedserve.core.kv_disk import DiskTier, check_disk_fits, measure_disk_read_bandwidth, num_disk_slots_for
from pagedserve.core.kv_events import KVEvent, KVEventLog, device_medium
from pagedserve.core.outputs import EngineCoreOutputs, SchedulerStats
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import PreemptionCosts, Scheduler, SchedulerOutput
from pagedserve.plan.kv_budget import (KVPoolSize, ModelShape, blocks_per_request, size_kv_pool_for_dtype,
                                       swap_space_line)
from pagedserve.plan.parallel import stage_layer_counts

logger = logging.getLogger("pagedserve.engine")

# A step computing fewer tokens than this says little about the per-token prefill cost.
_COST_UPDATE_MIN_TOKENS = 64
_COST_UPDATE_WEIGHT = 0.2


@dataclass
class StepTrace:
    """One engine step as `--step-trace-path` records it; `pagedserve simulate calibrate`
    fits the cost model to these."""

    new_tokens: list[int]     # per scheduled request: tokens computed this step
    context_lens: list[int]   # per scheduled request: its context after this step
    num_swap_blocks: int = 0
    duration: float = 0.0     # execute() only
    step_time: float = 0.0    # the whole step: schedule, execute, update
    # When the step ended, on the core's clock (time.monotonic in the engine, the virtual
    # clock in the simulator): the server's request trace stamps its events on the same
    # clock, so a request's first token is matched to its step by this value.
    t_end: float = 0.0
    # CPU seconds the engine's thread spent in the step (time.thread_time; the virtual step
    # time in the simulator). step_time / cpu_time is how much of the wall clock the thread
    # waited: for other processes on a shared machine, or for the interpreter lock. With
    # intra-op threads > 1 it counts the engine thread's share only.
    cpu_time: float = 0.0
    num_outputs: int = 0      # requests that sampled a token this step
    num_unfinished: int = 0   # running + waiting + swapped after the step: > 0, the next step follows at once

    def __post_init__(self) -> None:
        if not self.step_time:  # traces written before step_time existed
            self.step_time = self.duration

    @property
    def num_tokens(self) -> int:
        return sum(self.new_tokens)

    @property
    def num_reqs(self) -> int:
        return len(self.new_tokens)

    @classmethod
    def of(cls, out: SchedulerOutput, duration: float, step_time: float, t_end: float = 0.0,
           cpu_time: float = 0.0) -> "StepTrace":
        st = out.stats
        return cls(new_tokens=[r.num_new_tokens for r in out.scheduled],
                   context_lens=[r.context_len for r in out.scheduled],
                   num_swap_blocks=len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in),
                   duration=duration, step_time=step_time, t_end=t_end, cpu_time=cpu_time,
                   num_outputs=sum(1 for r in out.scheduled if r.sample),
                   num_unfinished=st.num_running + st.num_waiting + st.num_swapped)

    @classmethod
    def from_dict(cls, d: dict) -> "StepTrace":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def size_pool(config: EngineConfig, shape: ModelShape, kv_dtype: str,
              kv_cache_memory: int | None = None) -> KVPoolSize:
    """How many blocks each rank's pool gets: the very function `pagedserve plan` calls, with
    `kv_cache_memory` (default: the knob) as one rank's budget and one rank's bytes per token
    (its share of the KV heads) in the resolved `kv_dtype`, scales included. An exact
    num_kv_blocks (tests, reproductions) wins over bytes."""
    if kv_cache_memory is None:
        kv_cache_memory = config.kv_cache_memory or 0
    # Pipeline stages: each pool holds its stage's layers and all hold the same blocks (one
    # scheduler), so the stage with the fewest blocks in its budget, the one with the most
    # layers, sets them and its bytes per token are the pool's (plan's binding stage).
    pool = min((size_kv_pool_for_dtype(replace(shape, num_layers=n), kv_cache_memory, kv_dtype,
                                       block_size=config.block_size, tp=config.tensor_parallel_size)
                for n in stage_layer_counts(shape.num_layers, config.pipeline_parallel_size)),
               key=lambda p: p.num_blocks)
    if config.num_kv_blocks is not None:
        pool = KVPoolSize(config.num_kv_blocks, config.block_size, pool.bytes_per_token)
    return pool


def check_pool_fits(pool: KVPoolSize, config: EngineConfig) -> None:
    """Refuse, with the numbers, a pool that cannot hold one max_model_len request."""
    need = blocks_per_request(config.max_model_len, config.block_size)
    if pool.num_blocks < need:
        raise ValueError(
            f"kv_cache_memory: the KV pool holds {pool.num_blocks} blocks ({pool.num_tokens} tokens, "
            f"{pool.num_bytes / 2**20:.1f} MiB at {pool.bytes_per_token} bytes per token), but one request of "
            f"max_model_len={config.max_model_len} tokens needs {need} blocks "
            f"({need * pool.bytes_per_block / 2**20:.1f} MiB); raise kv_cache_memory/num_kv_blocks "
            f"or lower max_model_len")


def check_request_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Raise ValueError (naming the field) for a request that cannot fit max_model_len."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(f"prompt: this model's maximum context length is {max_model_len} tokens, "
                         f"but the prompt has {num_prompt_tokens} tokens (no room for any output)")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(f"max_tokens: this model's maximum context length is {max_model_len} tokens; "
                         f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                         f"prompt, {max_tokens} for the completion)")


def num_host_blocks_for(config: EngineConfig, pool: KVPoolSize) -> int:
    """The host swap pool: swap_space bytes cut into blocks of the device pool's size."""
    if config.preemption_mode == PreemptionMode.RECOMPUTE or not pool.bytes_per_block:
        return 0
    return int(config.swap_space // pool.bytes_per_block)


def num_tier_blocks_for(config: EngineConfig, pool: KVPoolSize) -> int:
    """The host KV tier: kv_offloading_size GiB over all ranks (vLLM's reading: the size is
    the sum across ranks), each rank holding its share of every block."""
    if not config.kv_offloading_size or not pool.bytes_per_block:
        return 0
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    return int(config.kv_offloading_size * 2**30 // (pool.bytes_per_block * world))


def host_memory_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_tier_fits(config: EngineConfig, pool: KVPoolSize, num_tier_blocks: int,
                    available: int | None = None) -> None:
    """Refuse, with the numbers, a host tier larger than the host memory available now, or
    too small to hold one block."""
    if not config.kv_offloading_size:
        return
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    if num_tier_blocks < 1:
        raise ValueError(f"kv_offloading_size: {config.kv_offloading_size:g} GiB holds no KV block "
                         f"({pool.bytes_per_block * world:,} bytes per block over {world} rank(s)); raise it")
    tier_bytes = num_tier_blocks * pool.bytes_per_block * world
    available = host_memory_available() if available is None else available
    if available is not None and tier_bytes > available:
        raise ValueError(f"kv_offloading_size: the host KV tier needs {tier_bytes / 2**30:.2f} GiB "
                         f"({num_tier_blocks:,} blocks x {pool.bytes_per_block / 2**10:,.0f} KiB x {world} rank(s)) "
                         f"but only {available / 2**30:.2f} GiB of host memory is available (MemAvailable); "
                         f"lower --kv-offloading-size")


def open_disk_tier(config: EngineConfig, pool: KVPoolSize, executor: Executor, fingerprint: dict,
                   costs: PreemptionCosts | None) -> DiskTier:
    """The disk tier: sized, checked against the free disk, its index opened (refused when
    another model or layout wrote it), the ranks' files opened, its read bandwidth measured."""
    path = os.path.abspath(config.kv_offloading_disk)
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    size = config.kv_offloading_disk_size
    if config.data_parallel_size > 1:  # each core its own directory and share of the size
        path = os.path.join(path, f"dp{config.data_parallel_rank}")
        size /= config.data_parallel_size
    os.makedirs(path, exist_ok=True)
    num_slots = num_disk_slots_for(size, pool.bytes_per_block, world)
    check_disk_fits(path, size, num_slots, pool.bytes_per_block, world)
    open_files = getattr(executor, "open_disk_tier", None)
    if open_files is None:
        raise ValueError(f"kv_offloading_disk: the {type(executor).__name__} executor has no disk tier")
    disk = DiskTier(path, num_slots, config.block_size,
                    dict(fingerprint, block_size=config.block_size, bytes_per_block=pool.bytes_per_block,
                         tensor_parallel_size=config.tensor_parallel_size,
                         pipeline_parallel_size=config.pipeline_parallel_size))
    open_files(path, num_slots)
    disk.read_bandwidth = measure_disk_read_bandwidth(path)
    if costs is not None:
        costs.disk_read_bandwidth = disk.read_bandwidth
    logger.info("disk KV tier: %d blocks x %.0f KiB = %.2f GiB in %s (%d prefix tokens), read %.2f GB/s",
                num_slots, pool.bytes_per_block / 2**10, num_slots * pool.bytes_per_block / 2**30, path,
                num_slots * config.block_size, disk.read_bandwidth / 1e9)
    return disk


class EngineCore:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, executor: Executor,
                 pool: KVPoolSize, trace_path: str | None = None,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self.config = config
        self.scheduler = scheduler
        self.executor = executor
        self.pool = pool
        self._trace = open(trace_path, "a") if trace_path else None
        self._cpu_clock = cpu_clock  # the step trace's cpu_time
        # What watches the core from its loop (engine/kv_events.KVEventsHook): each has
        # after_step(core, outputs) and shutdown(). The loops call `observe` after every step
        # or idle snapshot; the core never calls them itself, so the simulator has none.
        self.observers: list = []

    @classmethod
    def build(cls, config: EngineConfig, executor: Executor, pool: KVPoolSize,
              clock: Callable[[], float] = time.monotonic,
              prefix_extra_keys: Callable[[Request], bytes] | None = None,
              cpu_clock: Callable[[], float] | None = None,
              host_memory: int | None = None, disk_fingerprint: dict | None = None) -> "EngineCore":
        """The one way to make a core: check the pool, allocate it (and the host pool),
        measure what auto preemption weighs, build the scheduler. `prefix_extra_keys` names
        what else a request's KV depends on (see core/kv_cache.py). `cpu_clock` times the
        step trace's cpu_time (default: this thread's CPU time; the simulator passes its
        virtual clock). `host_memory`: bytes the host tier may take (default: MemAvailable
        now; the simulator passes its deployment's). `disk_fingerprint`: what the disk tier's
        header must match (engine/llm_engine.py: model, config hash, dtypes, layout)."""
        check_pool_fits(pool, config)
        num_host_blocks = num_host_blocks_for(config, pool)
        num_tier_blocks = num_tier_blocks_for(config, pool)
        check_tier_fits(config, pool, num_tier_blocks, host_memory)
        if num_tier_blocks:
            logger.info("host KV tier: %d blocks x %.0f KiB = %.2f GiB per rank (%d prefix tokens)",
                        num_tier_blocks, pool.bytes_per_block / 2**10,
                        num_tier_blocks * pool.bytes_per_block / 2**30, num_tier_blocks * config.block_size)
        if num_host_blocks:
            logger.info("%s", swap_space_line(num_host_blocks, pool.bytes_per_block, config.device,
                                              config.tensor_parallel_size,
                                              probed=config.preemption_mode == PreemptionMode.AUTO))
        executor.initialize_cache(pool.num_blocks, num_host_blocks + num_tier_blocks)
        costs = None
        if (config.preemption_mode == PreemptionMode.AUTO and num_host_blocks) or num_tier_blocks:
            costs = PreemptionCosts(
                bytes_per_block=pool.bytes_per_block,
                host_bandwidth=executor.measure_host_bandwidth(),
                prefill_seconds_per_token=executor.profile_prefill(min(256, config.max_num_batched_tokens)))
            logger.info("auto preemption: host copy %.2f GB/s, prefill %.1f us/token",
                        costs.host_bandwidth / 1e9, costs.prefill_seconds_per_token * 1e6)
        scheduler = Scheduler.from_config(config, pool.num_blocks, clock=clock, num_host_blocks=num_host_blocks,
                                          costs=costs, prefix_extra_keys=prefix_extra_keys,
                                          num_tier_blocks=num_tier_blocks)
        if config.kv_offloading_disk:
            scheduler.kv.tier.disk = open_disk_tier(config, pool, executor, disk_fingerprint or {}, costs)
        return cls(config, scheduler, executor, pool, config.step_trace_path, cpu_clock or time.thread_time)

    # -- requests -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids: Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                        stop_reason: int | str | None = None) -> None:
        """End requests now (aborts; stop strings the front-end found): blocks return at once."""
        for rid in request_ids:
            self.scheduler.finish_request(rid, status, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the prefix cache as KV events see it (core/kv_events.py) ----------------------------
    def record_kv_events(self) -> None:
        """Have the pool log its KV events from now on. Only a loop that takes them each step
        (an observer calling take_kv_events) turns this on, so nothing piles up unread."""
        if self.scheduler.kv.pool.events is None:
            self.scheduler.kv.pool.events = KVEventLog(self.config.block_size, device_medium(self.config.device))
            if self.scheduler.kv.tier is not None:  # one log: the order across pool and tier is kept
                self.scheduler.kv.tier.events = self.scheduler.kv.pool.events
                if (disk := self.scheduler.kv.disk) is not None:
                    disk.events = self.scheduler.kv.pool.events
                    disk.announce()  # the blocks a previous run left

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events since the last call (none unless --kv-events-config enables them)."""
        events = self.scheduler.kv.pool.events
        return events.take() if events is not None else []

    def cached_block_hashes(self) -> set[int]:
        """Read-only: the external keys of every block the prefix cache can serve now (the
        device pool's and the host tier's)."""
        tier, disk = self.scheduler.kv.tier, self.scheduler.kv.disk
        return (self.scheduler.kv.pool.cached_block_hashes() | (tier.block_hashes() if tier is not None else set())
                | (disk.block_hashes() if disk is not None else set()))

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, the host tier's too (one AllBlocksCleared event); refused
        while a block is in use."""
        if not self.scheduler.kv.pool.reset_prefix_cache():
            return False
        if self.scheduler.kv.tier is not None:
            self.scheduler.kv.tier.clear()
        if self.scheduler.kv.disk is not None:
            self.scheduler.kv.disk.clear()
        return True

    # -- the step -------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        clock = self.scheduler.clock  # wall time in the engine, virtual time in the simulator
        tracing = self._trace is not None
        c0 = self._cpu_clock() if tracing else 0.0
        t0 = clock()
        out = self.scheduler.schedule()
        result = self.executor.execute(out)
        outputs = self.scheduler.update_from_output(out, result)
        self._update_costs(out, result.forward_time)
        self.scheduler.fill_state(out.stats)
        t1 = clock()
        step_time = t1 - t0
        if tracing and not out.is_empty:
            cpu = self._cpu_clock() - c0
            self._trace.write(StepTrace.of(out, result.duration, step_time, t1, cpu).to_json() + "\n")
            self._trace.flush()
        return EngineCoreOutputs(outputs, out.stats, t1, step_time, result.duration, result.forward_time)

    def _update_costs(self, out: SchedulerOutput, forward_time: float) -> None:
        """Keep the recompute estimate current: prefill-heavy steps tell the per-token cost."""
        costs = self.scheduler.costs
        if costs is None or out.num_batched_tokens < _COST_UPDATE_MIN_TOKENS:
            return
        per_token = forward_time / out.num_batched_tokens
        costs.prefill_seconds_per_token += _COST_UPDATE_WEIGHT * (per_token - costs.prefill_seconds_per_token)

    def snapshot(self) -> EngineCoreOutputs:
        """No step: the queue and pool state as of now (so gauges fall to 0 when idle)."""
        stats = SchedulerStats()
        self.scheduler.fill_state(stats)
        return EngineCoreOutputs([], stats, self.scheduler.clock())

    def observe(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Let the observers see the core after a step or snapshot (from the loop's thread)."""
        for observer in self.observers:
            observer.after_step(self, outputs)
        return outputs

    def shutdown(self) -> None:
        for observer in self.observers:
            observer.shutdown()
        self.observers = []
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        if (disk := self.scheduler.kv.disk) is not None:
            if disk.needs_sync:  # the writes since the last sync: durable, then recorded
                try:
                    self.executor.sync_disk_tier()
                    disk.flush_index()
                except Exception as e:  # noqa: BLE001 - a shutdown goes on; those blocks are just not kept
                    logger.warning("disk KV tier: the last writes were not kept: %s", e)
            disk.close()
        self.executor.shutdown()

