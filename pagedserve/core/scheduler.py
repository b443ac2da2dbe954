"""Continuous batching under one token budget.

One rule for prefill and decode: every request has `num_computed_tokens` and a target
`num_tokens`; each step grants it some new tokens. Running requests are served first (a
decode is a grant of 1, an unfinished prompt a chunk), then waiting ones in queue order
while `max_num_seqs` and `max_num_batched_tokens` allow. When the pool cannot supply a
block, the lowest-priority, latest-arrived running request is preempted.

The scheduler returns plain data (SchedulerOutput). It never sees a tensor: the engine,
the simulator and the property tests drive this same class.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from pagedserve.core.block_pool import BlockPool, KVBlock
from pagedserve.core.kv_cache import KVCacheManager
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling import SamplingParams


logger = logging.getLogger("pagedserve.scheduler")


@dataclass
class PreemptionCosts:
    """What `auto` preemption weighs per victim. The engine measures these (host copy
    bandwidth once at start-up, prefill seconds per token as it runs); the simulator
    takes them from its cost model."""

    bytes_per_block: int
    host_bandwidth: float              # bytes/s, device <-> host
    prefill_seconds_per_token: float

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.bytes_per_block / self.host_bandwidth  # out now, in later

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_seconds_per_token


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"


@dataclass
class ScheduledRequest:
    """What the executor needs to run one request's share of a step."""

    request_id: str
    start_pos: int              # = num_computed_tokens before this step
    token_ids: list[int]        # the new tokens to compute, positions start_pos..
    block_ids: list[int]        # the request's whole block table after allocation
    sample: bool                # True when this step reaches the end: a token is sampled
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerStats:
    num_batched_tokens: int = 0  # tokens computed this step (prefill chunks + decodes)
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_usage: float = 0.0
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    num_total_tokens: int = 0
    num_preempted: dict[str, int] = field(default_factory=dict)  # by mode
    num_recomputed_tokens: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # ended since the previous step
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    stats: SchedulerStats = field(default_factory=SchedulerStats)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in


@dataclass
class StepResult:
    """What an executor returns for one SchedulerOutput: the real model runner and the
    simulator's cost-model executor both fill this."""

    sampled: dict[str, int] = field(default_factory=dict)   # request id -> token, for requests that sampled
    logprobs: dict = field(default_factory=dict)             # request id -> TokenLogprobs
    duration: float = 0.0          # seconds spent in execute()
    forward_time: float = 0.0      # of which in the model forward + sampling


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic, host_pool: BlockPool | None = None,
                 costs: PreemptionCosts | None = None) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.host_pool = host_pool        # swap space; None = recompute only
        self.costs = costs
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted by _queue_key
        self.running: list[Request] = []  # kept sorted by _queue_key; victims come off the end
        self.swapped: list[Request] = []  # kept sorted by _queue_key; they hold host blocks only
        self.host_tables: dict[str, list[KVBlock]] = {}
        self.total_preemptions_by_mode = {"recompute": 0, "swap": 0}
        self.total_recomputed_tokens = 0
        self.total_blocks_swapped = {"out": 0, "in": 0}
        self._seq = itertools.count()
        self._order: dict[str, int] = {}
        self._finished_since_step: list[str] = []
        self.total_preemptions = 0
        self.total_partial_prefills = 0  # prompt chunks that did not reach the end (chunked prefill)

    @classmethod
    def from_config(cls, config, num_blocks: int, clock: Callable[[], float] = time.monotonic,
                    num_host_blocks: int = 0, costs: PreemptionCosts | None = None) -> "Scheduler":
        """Build pool + block tables + scheduler from an EngineConfig: the engine and the
        simulator both come through here, so they run the very same policy."""
        pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        host_pool = BlockPool(num_host_blocks) if num_host_blocks > 0 and config.preemption_mode != "recompute" else None
        return cls(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            scheduling_policy=config.scheduling_policy,
            preemption_mode=config.preemption_mode,
        ), KVCacheManager(pool, config.block_size), clock=clock, host_pool=host_pool, costs=costs)

    # -- queue order -------------------------------------------------------------------
    def _queue_key(self, req: Request) -> tuple:
        order = self._order[req.request_id]
        if self.config.scheduling_policy == "priority":
            return (req.priority, req.times.arrival, order)
        return (req.times.arrival, order)

    def _insert(self, queue: list[Request], req: Request) -> None:
        bisect.insort(queue, req, key=self._queue_key)

    # -- requests in and out ------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self._order[req.request_id] = next(self._seq)
        req.status = RequestStatus.WAITING
        self._insert(self.waiting, req)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason=None) -> Request | None:
        """End a request wherever it is (aborts and engine-side stop strings come here)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
            self.host_pool.free(self.host_tables.pop(request_id))
        self._release(req)
        req.status = status
        req.stop_reason = stop_reason if stop_reason is not None else req.stop_reason
        req.times.finished = self.clock()
        self._order.pop(request_id, None)
        self._finished_since_step.append(request_id)
        return req

    def _release(self, req: Request) -> None:
        self.kv.free(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    # -- one step ---------------------------------------------------------------------
    def _grant(self, req: Request, budget: int) -> int:
        num_new = req.num_tokens - req.num_computed_tokens
        if self.config.long_prefill_token_threshold and num_new > 1:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return min(num_new, budget)

    def _choose_mode(self, victim: Request) -> str:
        mode = self.config.preemption_mode
        if mode == "recompute" or self.host_pool is None:
            return "recompute"
        num_blocks = self.kv.num_blocks_held(victim.request_id)
        if self.host_pool.num_free_blocks < num_blocks:
            return "recompute"  # host pool full: this victim is recomputed
        if mode == "swap" or self.costs is None:
            return "swap"
        swap_s = self.costs.swap_seconds(num_blocks)
        recompute_s = self.costs.recompute_seconds(victim.num_computed_tokens)
        choice = "swap" if swap_s <= recompute_s else "recompute"
        logger.debug("preempt %s: swap %d blocks %.2f ms vs recompute %d tokens %.2f ms -> %s",
                     victim.request_id, num_blocks, swap_s * 1e3, victim.num_computed_tokens,
                     recompute_s * 1e3, choice)
        return choice

    def _preempt(self, victim: Request, stats: SchedulerStats, swap_out: list[tuple[int, int]]) -> None:
        """Swap: its blocks go to the host pool and it keeps its progress. Recompute: its
        KV is dropped and it is rewound. Either way it is requeued in arrival order."""
        mode = self._choose_mode(victim)
        victim.num_preemptions += 1
        self.total_preemptions += 1
        self.total_preemptions_by_mode[mode] += 1
        stats.num_preempted[mode] = stats.num_preempted.get(mode, 0) + 1
        if mode == "swap":
            device_blocks = self.kv.take_blocks(victim)
            host_blocks = self.host_pool.allocate(len(device_blocks))
            swap_out.extend((d.block_id, h.block_id) for d, h in zip(device_blocks, host_blocks))
            self.kv.pool.free(list(reversed(device_blocks)))  # the copy runs before any reuse
            self.host_tables[victim.request_id] = host_blocks
            stats.num_blocks_swapped_out += len(device_blocks)
            self.total_blocks_swapped["out"] += len(device_blocks)
            victim.status = RequestStatus.SWAPPED
            self._insert(self.swapped, victim)
            return
        stats.num_recomputed_tokens += victim.num_computed_tokens
        self.total_recomputed_tokens += victim.num_computed_tokens
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self._insert(self.waiting, victim)

    def _swap_in(self, req: Request, num_new: int, swap_in: list[tuple[int, int]], stats: SchedulerStats) -> bool:
        """Give a swapped request device blocks for its saved KV plus its next grant."""
        host_blocks = self.host_tables[req.request_id]
        if not self.kv.allocate_slots(req, num_new):
            return False
        device_blocks = self.kv.block_tables[req.request_id][: len(host_blocks)]
        swap_in.extend((h.block_id, d.block_id) for h, d in zip(host_blocks, device_blocks))
        self.host_pool.free(self.host_tables.pop(req.request_id))
        stats.num_blocks_swapped_in += len(host_blocks)
        self.total_blocks_swapped["in"] += len(host_blocks)
        return True

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        stats = SchedulerStats()
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        now = self.clock()

        # 1. Running requests first, in queue order; victims come off the end.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._grant(req, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim, stats, swap_out)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1

        # 2. Swapped requests come back before anyone new is admitted.
        while not preempted and self.swapped and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.swapped[0]
            num_new = self._grant(req, budget)
            if not self._swap_in(req, num_new, swap_in, stats):
                break
            self.swapped.pop(0)
            req.status = RequestStatus.RUNNING
            self._insert(self.running, req)
            scheduled.append((req, num_new))
            budget -= num_new

        # 3. Waiting requests, only in a step that preempted nobody and left nobody swapped.
        while (not preempted and not self.swapped and self.waiting and budget > 0
               and len(self.running) < cfg.max_num_seqs):
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            num_cached = len(cached) * self.kv.block_size
            req.num_computed_tokens = num_cached
            num_new = self._grant(req, budget)
            if not cfg.enable_chunked_prefill and num_new < req.num_tokens - num_cached:
                req.num_computed_tokens = 0
                break  # the whole prompt must fit this step; FCFS: nobody overtakes
            if not self.kv.allocate_slots(req, num_new, cached):
                req.num_computed_tokens = 0
                break
            self.kv.record_prefix_lookup(req, num_cached)
            stats.prefix_cache_queries += req.num_tokens
            stats.prefix_cache_hits += num_cached
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
            self._insert(self.running, req)
            scheduled.append((req, num_new))
            budget -= num_new

        out = SchedulerOutput(
            scheduled=[self._describe(req, n) for req, n in scheduled],
            num_batched_tokens=cfg.max_num_batched_tokens - budget,
            preempted_ids=preempted,
            finished_ids=self._finished_since_step,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            stats=stats,
        )
        self._finished_since_step = []
        stats.num_batched_tokens = out.num_batched_tokens
        self._fill_stats(stats)
        return out

    def _describe(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(
            request_id=req.request_id,
            start_pos=start,
            token_ids=req.all_token_ids[start:start + num_new],
            block_ids=self.kv.block_ids(req.request_id),
            sample=start + num_new == req.num_tokens,
            sampling_params=req.sampling_params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
        )

    def _fill_stats(self, stats: SchedulerStats) -> None:
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting)
        stats.num_swapped = len(self.swapped)
        stats.kv_usage = self.kv.usage
        stats.num_used_blocks = self.kv.num_used_blocks
        stats.num_total_blocks = self.kv.pool.num_blocks
        stats.num_total_tokens = self.kv.pool.num_blocks * self.kv.block_size

    # -- after the executor ran ----------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> tuple[list[Request], list[Request]]:
        """Advance computed tokens, append sampled tokens, apply stop rules.

        Returns (requests that got a new token, requests that finished this step).
        """
        now = self.clock()
        updated: list[Request] = []
        finished: list[Request] = []
        for sr in out.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += sr.num_new_tokens
            self.kv.cache_full_blocks(req)
            if not sr.sample:
                self.total_partial_prefills += 1
                continue  # a prompt chunk that is not the last: nothing to sample yet
            token = sampled[sr.request_id]
            req.append_output_token(token)
            if req.times.first_token is None:
                req.times.first_token = now
            req.times.last_token = now
            updated.append(req)
            status, reason = self._check_stop(req, token)
            if status is not None:
                self.finish_request(req.request_id, status, reason)
                finished.append(req)
        return updated, finished

    def _check_stop(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        params = req.sampling_params
        past_min = req.num_output_tokens >= params.min_tokens
        if past_min and not params.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if past_min and token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None
