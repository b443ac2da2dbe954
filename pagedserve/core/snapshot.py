"""What the KV pool and the queues hold right now, compactly: the dashboard's pool view.

Only the engine loop may read the scheduler and the KV manager, so the loop takes the
snapshot (after a step, when `SnapshotGate.take` says one is due: engine/core_loop.py
PoolView) and sends it to the front-end as its own message, after that step's outputs. Torch-free, like the rest of core/.

A pool is encoded as runs over its block ids, `RUN_WIDTH` ints per run, flat:

    start, length, owner, first_pos, pos_step, ref_cnt, cached

- `owner`: index into the snapshot's `requests` rows, or FREE (-1);
- block `start + k` sits at position `first_pos + k * pos_step` of its owner's block table
  (pos_step is +1 or -1; 0 for free runs);
- `ref_cnt`: every block of the run has it (ref > 1: a prefix block shared by several tables);
- `cached`: 1 if the block is published in the prefix cache; a free cached block is
  "cached-free" (its KV is kept and can be reused until the block is handed out again).

Invariants: the runs cover every block id once, in order; the blocks of runs with
ref_cnt > 0 number exactly `num_used_blocks`. A block held by several tables is shown
under the first holder in row order (its ref_cnt says how many hold it). A run is cut only
where the owner, the position sequence, ref_cnt or cached changes, so building it costs
O(blocks held + blocks cached + runs log runs): the free, uncached rest of a large pool is
never visited.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from pagedserve.core.kv_cache import KVCacheView, TableRows


RUN_WIDTH = 7
FREE = -1
REQUEST_COLUMNS = ("request_id", "state", "num_prompt_tokens", "num_output_tokens", "num_computed_tokens",
                   "num_blocks", "num_host_blocks", "num_preemptions", "arrival_time")
MAX_WAITING_ROWS = 256  # the waiting queue can be long; its head is what an operator needs to see


@dataclass
class PoolSnapshot:
    time: float                      # the core's clock (virtual in the simulator)
    block_size: int
    num_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int
    runs: list[int]                  # the device pool (see the module docstring)
    num_host_blocks: int             # 0: no host swap pool
    num_host_used_blocks: int
    host_runs: list[int]             # the host swap pool: blocks of swapped-out requests
    requests: list[list]             # rows in REQUEST_COLUMNS order: running, swapped, then waiting
    num_waiting_unlisted: int = 0    # waiting requests past MAX_WAITING_ROWS
    cost: float = 0.0                # CPU seconds the engine thread spent taking it
    # The host KV tier (--kv-offloading-size) in the same host pool: its blocks are the host
    # runs' cached free ones (no table holds them); 0 blocks: no tier.
    num_tier_blocks: int = 0
    num_tier_used_blocks: int = 0

    def to_dict(self) -> dict:
        return {"time": self.time, "block_size": self.block_size, "num_blocks": self.num_blocks,
                "num_used_blocks": self.num_used_blocks, "num_cached_free_blocks": self.num_cached_free_blocks,
                "runs": self.runs, "num_host_blocks": self.num_host_blocks,
                "num_host_used_blocks": self.num_host_used_blocks, "host_runs": self.host_runs,
                "request_columns": list(REQUEST_COLUMNS), "requests": self.requests,
                "num_waiting_unlisted": self.num_waiting_unlisted, "cost": self.cost,
                "num_tier_blocks": self.num_tier_blocks, "num_tier_used_blocks": self.num_tier_used_blocks}


def _table_runs(owner: int, table: TableRows, shared_seen: set[int], out: list[tuple]) -> None:
    """Append the runs of one block table to `out` (unsorted). A shared block (ref > 1) goes
    to the first table that shows it; `shared_seen` remembers those."""
    ids, refs, hashed = table
    n = len(ids)
    i = 0
    while i < n:
        bid, ref, cached = ids[i], refs[i], hashed[i]
        if ref > 1:
            if bid in shared_seen:
                i += 1
                continue
            shared_seen.add(bid)
        j = i + 1
        step = ids[j] - bid if j < n else 0
        if step == 1 or step == -1:
            while (j < n and ids[j] - ids[j - 1] == step and refs[j] == ref and hashed[j] == cached
                   and (ref == 1 or ids[j] not in shared_seen)):
                if ref > 1:
                    shared_seen.add(ids[j])
                j += 1
        if j - i == 1:
            out.append((bid, 1, owner, i, 0, ref, int(cached)))
        elif step == 1:
            out.append((bid, j - i, owner, i, 1, ref, int(cached)))
        else:  # ids fall as positions rise: the run starts at its lowest id, the table's last
            out.append((ids[j - 1], j - i, owner, j - 1, -1, ref, int(cached)))
        i = j


def encode_pool(num_blocks: int, tables: Iterable[tuple[int, TableRows]],
                cached_free_ids: Iterable[int] = ()) -> list[int]:
    """Runs (RUN_WIDTH ints each) for a pool of `num_blocks` whose held blocks are the
    (owner, block table) pairs in `tables`; `cached_free_ids`: its free blocks that keep a prefix."""
    segments: list[tuple] = []
    shared_seen: set[int] = set()
    for owner, table in tables:
        _table_runs(owner, table, shared_seen, segments)
    previous = -2
    for bid in sorted(cached_free_ids):  # consecutive cached-free ids merge into one run
        if bid == previous + 1:
            start, length, *rest = segments[-1]
            segments[-1] = (start, length + 1, *rest)
        else:
            segments.append((bid, 1, FREE, 0, 0, 0, 1))
        previous = bid
    segments.sort()
    runs: list[int] = []
    cursor = 0
    for segment in segments:
        start, length = segment[0], segment[1]
        if start > cursor:
            runs.extend((cursor, start - cursor, FREE, 0, 0, 0, 0))
        runs.extend(segment)
        cursor = start + length
    if cursor < num_blocks:
        runs.extend((cursor, num_blocks - cursor, FREE, 0, 0, 0, 0))
    return runs


def decode_runs(runs: list[int], num_blocks: int) -> list[tuple[int, int, int, int]]:
    """Per block: (owner, position, ref_cnt, cached). For tests and tools; the page decodes in JS."""
    out: list[tuple[int, int, int, int] | None] = [None] * num_blocks
    for i in range(0, len(runs), RUN_WIDTH):
        start, length, owner, first_pos, step, ref_cnt, cached = runs[i:i + RUN_WIDTH]
        for k in range(length):
            out[start + k] = (owner, first_pos + k * step if owner != FREE else 0, ref_cnt, cached)
    if any(b is None for b in out):
        raise ValueError("runs do not cover the pool")
    return out  # type: ignore[return-value]


def take_snapshot(scheduler, max_waiting_rows: int = MAX_WAITING_ROWS) -> PoolSnapshot:
    """The pool, the host pool and the live requests as of now, read through the KV
    manager's read-only view (core/kv_cache.py KVCacheView). Engine loop only."""
    kv: KVCacheView = scheduler.kv.view()
    rows: list[list] = []
    device_tables: list[tuple[int, TableRows]] = []
    host_tables: list[tuple[int, TableRows]] = []
    listed = [*scheduler.running, *scheduler.swapped, *scheduler.waiting[:max_waiting_rows]]
    for owner, req in enumerate(listed):
        rid = req.request_id
        table = kv.device_table(rid)
        host = kv.host_table(rid)
        if table:
            device_tables.append((owner, table))
        if host:
            host_tables.append((owner, host))
        rows.append([rid, req.status.value, req.num_prompt_tokens, req.num_output_tokens, req.num_computed_tokens,
                     len(table.ids) if table else 0, len(host.ids) if host else 0, req.num_preemptions,
                     req.times.arrival])
    cached_free = kv.cached_free_block_ids()
    return PoolSnapshot(
        time=scheduler.clock(), block_size=kv.block_size, num_blocks=kv.num_blocks,
        num_used_blocks=kv.num_used_blocks, num_cached_free_blocks=len(cached_free),
        runs=encode_pool(kv.num_blocks, device_tables, cached_free),
        num_host_blocks=kv.num_host_blocks,
        num_host_used_blocks=kv.num_host_swap_blocks if kv.num_tier_blocks else kv.num_host_used_blocks,
        host_runs=(encode_pool(kv.num_host_blocks, host_tables, kv.tier_host_block_ids())
                   if kv.num_host_blocks else []),
        requests=rows, num_waiting_unlisted=max(len(scheduler.waiting) - max_waiting_rows, 0),
        num_tier_blocks=kv.num_tier_blocks, num_tier_used_blocks=kv.num_tier_used_blocks)


@dataclass
class SnapshotGate:
    """When the engine loop takes a snapshot: only while someone watches, at most `max_rate`
    per second, and spending at most `max_share` of the loop's time on it (a snapshot that
    cost t seconds waits t / max_share before the next). The cost is the engine thread's own
    CPU time (`cost_clock`), not wall time: waiting for the GIL while the front-end's loop
    encodes a frame is not the snapshot's cost. The front-end's loop counts watchers; the
    engine loop calls `take` after each step. An int written by one thread and read by the
    other needs no lock under the GIL; a stale read costs one snapshot."""

    max_rate: float = 4.0
    max_share: float = 0.01
    clock: Callable[[], float] = time.perf_counter
    cost_clock: Callable[[], float] = time.thread_time
    watchers: int = 0
    _next_due: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if not self.max_rate > 0:
            raise ValueError(f"max_rate: must be > 0 snapshots per second, got {self.max_rate}")
        if not 0 < self.max_share <= 1:
            raise ValueError(f"max_share: must be in (0, 1], got {self.max_share}")

    def add_watcher(self) -> None:
        self.watchers += 1
        self._next_due = 0.0  # a new page gets a pool view with the next step, not after a wait

    def remove_watcher(self) -> None:
        self.watchers = max(self.watchers - 1, 0)

    def set_watchers(self, watchers: int) -> None:
        """The count as the front-end keeps it (process mode: sent over the wire)."""
        if watchers > self.watchers:
            self._next_due = 0.0
        self.watchers = max(watchers, 0)

    def take(self, scheduler) -> PoolSnapshot | None:
        if not self.watchers:
            return None
        now = self.clock()
        if now < self._next_due:
            return None
        cpu0 = self.cost_clock()
        snapshot = take_snapshot(scheduler)
        snapshot.cost = self.cost_clock() - cpu0
        self._next_due = now + max(1.0 / self.max_rate, snapshot.cost / self.max_share)
        return snapshot
