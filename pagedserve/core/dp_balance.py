"""Where a data-parallel request goes (vLLM's -dp): the one placement rule that both the
server's DP client (engine/dp_client.py) and `pagedserve simulate -dp N` (sim/data_parallel.py)
call, so the simulator places requests exactly as the engine does. Torch-free.

- `EngineLoad.of(stats, pending)`: one core as the balancer sees it, from the last
  SchedulerStats the core reported and the requests sent to it that it has not taken in yet.
- `DPBalancer.place(prompt, loads)`: the core with the least 4 x waiting + running (vLLM's
  DP load-balancing score); a tie to the core holding more of the prompt's leading blocks
  (`PrefixRecord`: the block hashes of the prompts placed on each core, bounded by its
  pool), then to the one with the lower KV-cache usage, then to the lower rank.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Sequence

WAITING_WEIGHT = 4  # vLLM's DP load-balancing score: 4 x waiting + running


@dataclasses.dataclass
class EngineLoad:
    """One core as the balancer sees it."""

    waiting: int       # sent but not yet taken in, plus the core's own waiting queue
    running: int
    kv_usage: float    # used / total blocks

    @property
    def score(self) -> int:
        return WAITING_WEIGHT * self.waiting + self.running

    @classmethod
    def of(cls, stats, pending: int) -> "EngineLoad":
        """From a core's last reported SchedulerStats and its `pending` requests (sent to it,
        not yet taken in)."""
        blocks = stats.num_total_blocks
        return cls(pending + stats.num_waiting, stats.num_running, stats.num_used_blocks / blocks if blocks else 0.0)


def choose_engine(loads: list[EngineLoad], prefix_blocks: list[int] | None = None) -> int:
    """The rank a request goes to: the least load score; then the most leading prompt blocks
    already placed there (prefix-cache hits); then the lower KV-cache usage; then the lower rank."""
    prefix_blocks = prefix_blocks or [0] * len(loads)
    return min(range(len(loads)), key=lambda r: (loads[r].score, -prefix_blocks[r], loads[r].kv_usage, r))


class PrefixRecord:
    """The block hashes of the prompts placed on one core, most recent last, at most
    `capacity` of them (the core's pool size: it cannot cache more). Chained as the prefix
    cache chains them, so a hit on block i means blocks 0..i match too. It records what was
    sent, not what the core still caches (it may have evicted some): a tie-breaker."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = max(1, capacity)
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        out, parent = [], None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(token_ids[start:start + self.block_size])))
            out.append(parent)
        return out

    def num_cached_blocks(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def add(self, hashes: list[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


class DPBalancer:
    """The placement state of N cores: a prefix record per core and how many requests
    (prompts) each was given."""

    def __init__(self, block_size: int, pool_blocks: Sequence[int]) -> None:
        self.prefixes = [PrefixRecord(block_size, n) for n in pool_blocks]
        self.num_placed = [0] * len(pool_blocks)

    def place(self, prompt_token_ids: list[int], loads: list[EngineLoad]) -> int:
        """The rank for one prompt (all its samples), recorded as placed there."""
        hashes = self.prefixes[0].block_hashes(prompt_token_ids)
        rank = choose_engine(loads, [p.num_cached_blocks(hashes) for p in self.prefixes])
        self.prefixes[rank].add(hashes)
        self.num_placed[rank] += 1
        return rank
