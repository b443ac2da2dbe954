"""InstantExecutor: the Executor protocol with no model and no clock.

Every request whose step reaches its end samples a random token id in [16, vocab) (past the
special ids) at once; nothing is computed and no time passes. What is left to time or to
test is the engine's own work: schedule, KV bookkeeping, outputs, detokenization. Used by
the host probe (sim/host_probe.py), the step-overhead benchmarks and the engine tests; a
subclass may extend `execute` to record what the scheduler asked for.

The ids come from `random.Random(seed)` in the order single `randrange` calls would give
them, drawn a batch at a time so a step pays a list pop per token, not a `randrange`: the
host probe's per-request cost is a few microseconds, and a `randrange` a large part of one.
"""
from __future__ import annotations

import random

from pagedserve.core.outputs import StepResult

_BATCH = 4096


class InstantExecutor:
    dp_lockstep = None  # no DP attention + EP lockstep (core/executor.py)

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.rng = random.Random(seed)
        self._ids: list[int] = []  # drawn ahead, next id last

    def profile_kv_budget(self, gpu_memory_utilization: float, max_num_batched_tokens: int,
                          max_num_seqs: int) -> int:
        raise ValueError("InstantExecutor has no device to profile: configure num_kv_blocks or kv_cache_memory")

    def initialize_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        pass

    def measure_host_bandwidth(self) -> float:
        return 1e10

    def profile_prefill(self, num_tokens: int) -> float:
        return 1e-5

    def execute(self, out) -> StepResult:
        ids = self._ids
        sampled = {}
        for r in out.scheduled:
            if r.sample:
                if not ids:
                    ids.extend(self.rng.randrange(16, self.vocab) for _ in range(_BATCH))
                    ids.reverse()
                sampled[r.request_id] = ids.pop()
        return StepResult(sampled=sampled)

    def check_health(self) -> None:
        pass  # no model: nothing to watch

    def worker_pids(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        pass
