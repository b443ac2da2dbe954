"""Continuous batching under one token budget.

One rule for prefill and decode: every request has `num_computed_tokens` and a target
`num_tokens`; each step grants it some new tokens. Running requests are served first (a
decode is a grant of 1, an unfinished prompt a chunk), then swapped ones come back, then
waiting ones are admitted in queue order while `max_num_seqs` and `max_num_batched_tokens`
allow. When the pool cannot supply a block, the lowest-priority, latest-arrived running
request is preempted.

The scheduler returns plain data (SchedulerOutput) and sees blocks only as ids handed back
by the KV-cache manager. It never sees a tensor: the engine, the simulator and the
property tests drive this same class.

Invariants: every step respects max_num_seqs and max_num_batched_tokens; a step that
preempted anyone swaps nobody in and admits nobody (the freed room goes to those running);
a request's data reaches the executor once (NewRequestData), then only per-step diffs.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable

from msgspec import Struct, field

from pagedserve.config import PreemptionMode, SchedulingPolicy
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache import KVCacheManager
from pagedserve.core.kv_tier import HostTier
from pagedserve.core.outputs import EngineCoreOutput, SchedulerStats, StepResult
from pagedserve.core.request import FinishReason, Request, RequestStatus
from pagedserve.core.stop import check_token_stop
from pagedserve.sampling import SamplingParams

logger = logging.getLogger("pagedserve.scheduler")


@dataclass
class PreemptionCosts:
    """What `auto` preemption weighs per victim. The engine core measures these (host copy
    bandwidth once at start-up, prefill seconds per token as it runs); the simulator's
    executor derives them from its cost model through the same calls."""

    bytes_per_block: int
    host_bandwidth: float              # bytes/s, device <-> host
    prefill_seconds_per_token: float

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.bytes_per_block / self.host_bandwidth  # out now, in later

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_seconds_per_token

    def load_seconds(self, num_blocks: int) -> float:
        """A host-tier hit: one copy in (the copy out was paid when the pool evicted it)."""
        return num_blocks * self.bytes_per_block / self.host_bandwidth

    disk_read_bandwidth: float = 0.0   # bytes/s, disk -> host (measured at start-up with a disk tier)

    def disk_load_seconds(self, num_blocks: int) -> float:
        """A disk-tier hit: read into host blocks, then the host-tier load."""
        return num_blocks * self.bytes_per_block / self.disk_read_bandwidth + self.load_seconds(num_blocks)


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE


class NewRequestData(Struct, array_like=True):
    """Sent once, the first step a request is scheduled: what the executor keeps about it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


class ScheduledRequest(Struct, array_like=True):
    """One request's share of a step: a diff against what the executor already holds."""

    request_id: str
    start_pos: int              # = num_computed_tokens before this step
    token_ids: list[int]        # the new tokens to compute, positions start_pos..
    new_block_ids: list[int]    # blocks appended to its table this step
    resumed: bool               # its table starts afresh from new_block_ids (first run, after a preemption)
    sample: bool                # True when this step reaches the end: a token is sampled

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


class SchedulerOutput(Struct, array_like=True):
    """One step's instructions to the executor. A msgspec Struct: with tensor parallelism it
    is encoded once per step and the same bytes are sent to every rank (worker/multiproc_executor.py;
    worker/ray_executor.py for Ray actors)."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # ended since the previous step
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    # The disk tier (core/kv_disk.py), each rank its own shard: (host block, slot, key) written
    # first of all the step's copies, then (slot, host block, key) read after the swap-outs.
    disk_writes: list[tuple[int, int, bytes]] = field(default_factory=list)
    disk_reads: list[tuple[int, int, bytes]] = field(default_factory=list)
    disk_sync: bool = False  # the ranks fsync their disk-tier files after this step's writes

    @property
    def is_empty(self) -> bool:
        return (not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in
                and not self.disk_writes and not self.disk_reads)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic, costs: PreemptionCosts | None = None) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.costs = costs
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted by _queue_key
        self.running: list[Request] = []  # kept sorted by _queue_key; victims come off the end
        self.swapped: list[Request] = []  # kept sorted by _queue_key; they hold host blocks only
        self.total_preemptions_by_mode = {mode.value: 0 for mode in (PreemptionMode.RECOMPUTE, PreemptionMode.SWAP)}
        self.total_recomputed_tokens = 0
        self.total_blocks_swapped = {"out": 0, "in": 0}
        self.total_partial_prefills = 0  # prompt chunks that did not reach the end (chunked prefill)
        self.total_tier_blocks = {"stored": 0, "loaded": 0}  # host tier copies (out, in)
        self._disk_prefetched: set[str] = set()  # requests that waited a step for the disk tier
        self._seq = itertools.count()
        self._order: dict[str, int] = {}
        self._finished_since_step: list[str] = []
        self._known_to_executor: set[str] = set()
        self._resumed: set[str] = set()  # (re)admitted since their last step: their tables start afresh

    @classmethod
    def from_config(cls, config, num_blocks: int, clock: Callable[[], float] = time.monotonic,
                    num_host_blocks: int = 0, costs: PreemptionCosts | None = None,
                    prefix_extra_keys: Callable[[Request], bytes] | None = None,
                    num_tier_blocks: int = 0) -> "Scheduler":
        """Pool + KV manager + scheduler from an EngineConfig (EngineCore.build comes here).
        `num_host_blocks`: swap space; `num_tier_blocks`: the host KV tier, in the same host pool."""
        pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        num_swap_blocks = num_host_blocks if config.preemption_mode != PreemptionMode.RECOMPUTE else 0
        host_pool = (BlockPool(num_swap_blocks + num_tier_blocks, reuse_recent_first=True)
                     if num_swap_blocks + num_tier_blocks > 0 else None)
        tier = HostTier(host_pool, num_tier_blocks, config.block_size) if num_tier_blocks > 0 else None
        return cls(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            scheduling_policy=SchedulingPolicy(config.scheduling_policy),
            preemption_mode=PreemptionMode(config.preemption_mode),
        ), KVCacheManager(pool, config.block_size, host_pool, prefix_extra_keys, tier), clock=clock, costs=costs)

    # -- queue order -------------------------------------------------------------------
    def _queue_key(self, req: Request) -> tuple:
        order = self._order[req.request_id]
        if self.config.scheduling_policy == SchedulingPolicy.PRIORITY:
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
        """End a request wherever it is: its blocks (device and host) return at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._disk_prefetched.discard(request_id)
        queue = {RequestStatus.RUNNING: self.running, RequestStatus.WAITING: self.waiting,
                 RequestStatus.SWAPPED: self.swapped}.get(req.status)
        if queue is not None:
            queue.remove(req)
        self.kv.free(req)
        req.status = status
        if stop_reason is not None:
            req.stop_reason = stop_reason
        req.times.finished = self.clock()
        self._order.pop(request_id, None)
        self._resumed.discard(request_id)
        if request_id in self._known_to_executor:
            self._known_to_executor.discard(request_id)
            self._finished_since_step.append(request_id)
        return req

    @property
    def total_preemptions(self) -> int:
        return sum(self.total_preemptions_by_mode.values())

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
    def _grant(self, num_remaining: int, budget: int) -> int:
        if self.config.long_prefill_token_threshold and num_remaining > 1:
            num_remaining = min(num_remaining, self.config.long_prefill_token_threshold)
        return min(num_remaining, budget)

    def _choose_mode(self, victim: Request) -> PreemptionMode:
        mode = self.config.preemption_mode
        if mode == PreemptionMode.RECOMPUTE or not self.kv.can_swap_out(victim):
            return PreemptionMode.RECOMPUTE  # no swap space, or the host pool is full
        if mode == PreemptionMode.SWAP or self.costs is None:
            return PreemptionMode.SWAP
        num_blocks = self.kv.num_blocks_held(victim.request_id)
        swap_s = self.costs.swap_seconds(num_blocks)
        recompute_s = self.costs.recompute_seconds(victim.num_computed_tokens)
        choice = PreemptionMode.SWAP if swap_s <= recompute_s else PreemptionMode.RECOMPUTE
        logger.debug("preempt %s: swap %d blocks %.2f ms vs recompute %d tokens %.2f ms -> %s",
                     victim.request_id, num_blocks, swap_s * 1e3, victim.num_computed_tokens,
                     recompute_s * 1e3, choice.value)
        return choice

    def _tier_hits(self, req: Request, num_device_hit_tokens: int) -> list:
        """The host tier's blocks after the device hits, if loading them is cheaper than
        computing them by the cost rule preemption uses (no costs measured: always load)."""
        entries = self.kv.get_tier_hits(req, num_device_hit_tokens // self.kv.block_size)
        if entries and self.costs is not None and self.costs.host_bandwidth > 0:
            load_s = self.costs.load_seconds(len(entries))
            recompute_s = self.costs.recompute_seconds(len(entries) * self.kv.block_size)
            if load_s > recompute_s:
                logger.debug("tier hit %s: load %d blocks %.2f ms > recompute %.2f ms: recompute",
                             req.request_id, len(entries), load_s * 1e3, recompute_s * 1e3)
                return []
        return entries

    def _disk_prefetch(self, req: Request, num_hit_blocks: int) -> bool:
        """Start reading the disk tier's run after the hits into the host tier, when the cost
        rule says loading beats computing; the request waits one step for it (once)."""
        if req.request_id in self._disk_prefetched:
            return False
        entries = self.kv.get_disk_hits(req, num_hit_blocks)
        if not entries:
            return False
        costs = self.costs
        if costs is not None and costs.host_bandwidth > 0 and costs.disk_read_bandwidth > 0:
            load_s = costs.disk_load_seconds(len(entries))
            if load_s > costs.recompute_seconds(len(entries) * self.kv.block_size):
                return False
        self._disk_prefetched.add(req.request_id)
        return self.kv.disk.start_reads(entries, self.kv.host_pool) > 0

    def _preempt(self, victim: Request, stats: SchedulerStats, swap_out: list[tuple[int, int]]) -> None:
        """Swap: its blocks go to the host pool and it keeps its progress. Recompute: its
        KV is dropped and it is rewound. Either way it is requeued in queue order."""
        mode = self._choose_mode(victim)
        victim.num_preemptions += 1
        self.total_preemptions_by_mode[mode.value] += 1
        stats.num_preempted[mode.value] = stats.num_preempted.get(mode.value, 0) + 1
        if mode == PreemptionMode.SWAP:
            pairs = self.kv.swap_out(victim)
            swap_out.extend(pairs)
            stats.num_blocks_swapped_out += len(pairs)
            self.total_blocks_swapped["out"] += len(pairs)
            victim.status = RequestStatus.SWAPPED
            self._insert(self.swapped, victim)
            return
        stats.num_recomputed_tokens += victim.num_computed_tokens
        self.total_recomputed_tokens += victim.num_computed_tokens
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self._insert(self.waiting, victim)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        stats = SchedulerStats()
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        now = self.clock()
        self.kv.begin_step()

        # 1. Running requests first, in queue order; victims come off the end.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._grant(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while (new_ids := self.kv.allocate_slots(req, num_new)) is None:
                victim = self.running.pop()
                self._preempt(victim, stats, swap_out)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append(self._describe(req, num_new, new_ids))
                budget -= num_new
                i += 1

        # 2. Swapped requests come back before anyone new is admitted. Never in a step that
        # swapped out: host blocks freed here must not be reused before they are copied in.
        while not preempted and self.swapped and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.swapped[0]
            num_new = self._grant(req.num_tokens - req.num_computed_tokens, budget)
            pairs = self.kv.swap_in(req, num_new)
            if pairs is None:
                break
            self.swapped.pop(0)
            swap_in.extend(pairs)
            stats.num_blocks_swapped_in += len(pairs)
            self.total_blocks_swapped["in"] += len(pairs)
            req.status = RequestStatus.RUNNING
            self._insert(self.running, req)
            self._resumed.add(req.request_id)
            scheduled.append(self._describe(req, num_new, []))
            budget -= num_new

        # 3. Waiting requests, only in a step that preempted nobody and left nobody swapped.
        while (not preempted and not self.swapped and self.waiting and budget > 0
               and len(self.running) < cfg.max_num_seqs):
            req = self.waiting[0]
            looks_up = req.num_computed_tokens == 0 and not req.skips_prefix_cache
            hits, num_hit_tokens = self.kv.get_computed_blocks(req) if looks_up else ([], 0)
            tier_hits = self._tier_hits(req, num_hit_tokens) if looks_up else []
            num_tier_tokens = len(tier_hits) * self.kv.block_size
            if looks_up and self.kv.disk is not None and self._disk_prefetch(
                    req, (num_hit_tokens + num_tier_tokens) // self.kv.block_size):
                break  # its blocks come up from disk this step; it is admitted on the next
            num_remaining = req.num_tokens - req.num_computed_tokens - num_hit_tokens - num_tier_tokens
            num_new = self._grant(num_remaining, budget)
            if not cfg.enable_chunked_prefill and num_new < num_remaining:
                break  # the whole prompt must fit this step; FCFS: nobody overtakes
            new_ids = self.kv.allocate_slots(req, num_new, num_hit_tokens + num_tier_tokens, hits, tier_hits)
            if new_ids is None:
                break
            req.num_computed_tokens += num_hit_tokens + num_tier_tokens
            if looks_up:
                self.kv.record_prefix_lookup(req.num_tokens, num_hit_tokens)
                stats.prefix_cache_queries += req.num_tokens
                stats.prefix_cache_hits += num_hit_tokens
                stats.prefix_cache_evicted_hits += self.kv.count_evicted_hits(
                    req, (num_hit_tokens + num_tier_tokens) // self.kv.block_size)
                if self.kv.tier is not None:
                    self.kv.tier.count_hits(len(tier_hits))
                    stats.tier_queries += req.num_tokens
                    stats.tier_hits += num_tier_tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit_tokens + num_tier_tokens
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
            self._insert(self.running, req)
            self._resumed.add(req.request_id)
            scheduled.append(self._describe(req, num_new, new_ids))
            budget -= num_new

        new_requests = []
        known, requests = self._known_to_executor, self.requests
        num_decode_tokens = 0
        for sr in scheduled:
            req = requests[sr.request_id]
            if sr.request_id not in known:
                known.add(sr.request_id)
                new_requests.append(NewRequestData(req.request_id, req.prompt_token_ids, req.sampling_params))
            if len(sr.token_ids) == 1 and sr.start_pos >= len(req.prompt_token_ids):
                num_decode_tokens += 1
        stats.num_batched_tokens = cfg.max_num_batched_tokens - budget
        stats.num_decode_tokens = num_decode_tokens
        stats.num_prefill_tokens = stats.num_batched_tokens - stats.num_decode_tokens
        # The host tier's copies ride the swap lists: every device -> host copy before every
        # host -> device one (worker: copy_blocks), so an evicted block is out before it is reused.
        offloads, loads = self.kv.take_tier_copies()
        if offloads or loads:
            swap_out = swap_out + offloads
            swap_in = swap_in + loads
            stats.num_blocks_offloaded, stats.num_blocks_loaded = len(offloads), len(loads)
            self.total_tier_blocks["stored"] += len(offloads)
            self.total_tier_blocks["loaded"] += len(loads)
        disk_writes, disk_reads, disk_sync = (self.kv.disk.take_copies() if self.kv.disk is not None
                                              else ([], [], False))
        out = SchedulerOutput(
            disk_writes=disk_writes,
            disk_reads=disk_reads,
            disk_sync=disk_sync,
            scheduled=scheduled,
            num_batched_tokens=stats.num_batched_tokens,
            new_requests=new_requests,
            preempted_ids=preempted,
            finished_ids=self._finished_since_step,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            stats=stats,
        )
        self._finished_since_step = []
        self.fill_state(stats)
        return out

    def _describe(self, req: Request, num_new: int, new_block_ids: list[int]) -> ScheduledRequest:
        start = req.num_computed_tokens
        resumed = req.request_id in self._resumed
        if resumed:
            self._resumed.discard(req.request_id)
            new_block_ids = self.kv.block_ids(req.request_id)
        return ScheduledRequest(
            request_id=req.request_id,
            start_pos=start,
            token_ids=req.all_token_ids[start:start + num_new],
            new_block_ids=new_block_ids,
            resumed=resumed,
            sample=start + num_new == req.num_tokens,
        )

    def _finish_disk_copies(self, out: SchedulerOutput, result: StepResult) -> None:
        """The disk tier's writes are durable (indexed now); its reads that came back whole
        join the host tier, the others are freed (a miss: those tokens are computed)."""
        if not out.disk_writes and not out.disk_reads and not out.disk_sync and not result.disk_error:
            return
        tier = self.kv.tier
        for entry, host in self.kv.disk.finish_step(result.disk_error, result.disk_failed_reads):
            if entry is None:
                self.kv.host_pool.free([host])
            else:
                tier.adopt(host, entry.key, entry.parent_key, entry.content)

    def fill_state(self, stats: SchedulerStats) -> None:
        """Queue and pool state, as of now."""
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting)
        stats.num_swapped = len(self.swapped)
        stats.kv_usage = self.kv.usage
        stats.num_used_blocks = self.kv.num_used_blocks
        stats.num_total_blocks = self.kv.num_total_blocks
        stats.num_total_tokens = self.kv.num_total_blocks * self.kv.block_size
        if self.kv.tier is not None:
            stats.tier_used_blocks = self.kv.tier.num_blocks
            stats.tier_total_blocks = self.kv.tier.capacity

    # -- after the executor ran ----------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled tokens, apply the token stop rules.

        Returns one output per request that gained a token or finished this step.
        """
        now = self.clock()
        outputs: list[EngineCoreOutput] = []
        if self.kv.disk is not None:
            self._finish_disk_copies(out, result)
        # Read once per step, not per request: most steps have no prompt logprobs, errors or
        # logprobs, and no prefix cache to publish to.
        requests, running = self.requests, RequestStatus.RUNNING
        cache_blocks = self.kv.cache_blocks if self.kv.caches_blocks else None
        prompt_logprobs, errors, logprobs = result.prompt_logprobs, result.errors, result.logprobs
        sampled = result.sampled
        max_model_len = self.config.max_model_len
        for sr in out.scheduled:
            rid = sr.request_id
            req = requests.get(rid)
            if req is None or req.status is not running:
                continue  # aborted while the step ran
            req.num_computed_tokens += len(sr.token_ids)
            if cache_blocks is not None:
                cache_blocks(req, req.num_computed_tokens)
            if prompt_logprobs:
                scored = prompt_logprobs.get(rid)
                if scored and req.prompt_logprobs is not None:
                    req.prompt_logprobs.extend(scored)
            if not sr.sample:
                self.total_partial_prefills += 1
                continue  # a prompt chunk that is not the last: nothing to sample yet
            error = errors.get(rid) if errors else None
            if error is not None:  # it sampled nothing it may keep: it ends here, its blocks return
                self.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR,
                                                num_preemptions=req.num_preemptions, error=error))
                continue
            token = sampled[rid]
            req.append_output_token(token)
            lp = logprobs.get(rid) if logprobs else None
            output = EngineCoreOutput(rid, [token], [lp] if lp is not None else None,
                                      num_preemptions=req.num_preemptions)
            if req.times.first_token is None:
                req.times.first_token = now
                output.first_scheduled_time = req.times.first_scheduled
                output.num_cached_tokens = req.num_cached_tokens
                output.arrival_time = req.times.arrival
                output.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
            req.times.last_token = now
            status, reason = check_token_stop(req, token, max_model_len)
            if status is not None:
                self.finish_request(req.request_id, status, reason)
                output.finish_reason = status.finish_reason
                output.stop_reason = req.stop_reason
            outputs.append(output)
        return outputs
