"""SimExecutor: the engine's executor interface with a cost model in place of a model.

`execute(SchedulerOutput) -> StepResult` like worker.model_runner.ModelRunner: every
request whose step reaches its end gets a sampled token (any valid id; requests end by
their max_tokens, the workload's output length, since the simulator sets ignore_eos),
and the step's duration comes from the cost model. No tensors, no torch.
"""
from __future__ import annotations

import random

from pagedserve.core.scheduler import StepResult


class SimExecutor:
    def __init__(self, cost_model, vocab_size: int = 32000, seed: int = 0) -> None:
        self.cost_model = cost_model
        self._rng = random.Random(seed)
        self._low = min(16, max(vocab_size - 1, 0))  # skip special ids, as the workloads do
        self._high = max(vocab_size, self._low + 1)
        self._ids = [self._rng.randrange(self._low, self._high) for _ in range(4099)]
        self._next = 0
        self.total_time = 0.0
        self.num_steps = 0

    def execute(self, out) -> StepResult:
        # Token ids from a pre-drawn random cycle: as good as fresh draws for anything the
        # scheduler looks at (stop checks, prefix hashes), at a fraction of the cost.
        ids, k = self._ids, self._next
        sampled = {}
        for r in out.scheduled:
            if r.sample:
                sampled[r.request_id] = ids[k]
                k = (k + 1) % len(ids)
        self._next = k
        duration = self.cost_model.step_time(out) if not out.is_empty else 0.0
        self.total_time += duration
        self.num_steps += 1
        return StepResult(sampled=sampled, duration=duration, forward_time=duration)
