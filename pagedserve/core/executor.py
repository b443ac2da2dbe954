"""The executor seam: what the engine core asks of whatever runs the model.

Implementations (worker/executors.py picks one from the config): worker.model_runner.ModelRunner
(the model in this process), worker.multiproc_executor.MultiprocExecutor (one process per
tensor-parallel rank), worker.ray_executor.RayExecutor (one Ray actor per rank), and
sim.executor.SimExecutor (a cost model on a virtual clock, no tensors). An executor never
calls back into the scheduler; it keeps what NewRequestData told it and applies each
step's diffs. Every executor answers `check_health()` (the engine-core loop calls it between
steps; it raises when a rank has died, and has nothing to check when the model runs in this
process) and `worker_pids()` (the processes of its ranks, for the stall and death reports),
and has a `dp_lockstep`: None, except on the model runner of a data-parallel core whose MoE
layers exchange tokens with the other cores' (DP attention + EP, worker/dp_lockstep.py), where
the engine-core loop steps in lockstep with the other cores through it.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from pagedserve.core.outputs import StepResult
from pagedserve.core.scheduler import SchedulerOutput


class Lockstep(Protocol):
    """What the engine-core loop asks of a data-parallel core that steps with the others (DP
    attention + EP; worker/dp_lockstep.py implements it): agree each turn whether any core has
    work or stops, count this core's forwards, run a pass with no tokens of its own."""

    num_forwards: int

    def agree(self, has_work: bool, stopping: bool) -> tuple[bool, bool]: ...

    def dummy_step(self) -> None: ...


@runtime_checkable
class Executor(Protocol):
    dp_lockstep: Lockstep | None   # DP attention + EP only (see above); None everywhere else

    def profile_kv_budget(self, gpu_memory_utilization: float, max_num_batched_tokens: int,
                          max_num_seqs: int) -> int:
        """Bytes a device KV pool may take (asked only when no size was configured)."""
        ...

    def initialize_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        """Allocate the device KV pool and the host swap pool (0 blocks = none)."""
        ...

    def measure_host_bandwidth(self) -> float:
        """Bytes/s of a device <-> host block copy (auto preemption weighs it)."""
        ...

    def profile_prefill(self, num_tokens: int) -> float:
        """Seconds per token of a prefill of `num_tokens` (auto preemption weighs it)."""
        ...

    def execute(self, out: SchedulerOutput) -> StepResult:
        ...

    def check_health(self) -> None:
        """Raise if a part of the executor has died (a rank); cheap, called between steps."""
        ...

    def worker_pids(self) -> list[int]:
        """The process ids of its ranks, in rank order ([]: the model runs in this process)."""
        ...

    def shutdown(self) -> None:
        ...
