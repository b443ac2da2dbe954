"""DP attention + EP (-dp N --enable-expert-parallel on an MoE model): the N engine cores'
models form one gloo process group, in which their MoE layers exchange tokens
(model/moe.py SparseMoeBlock._forward_dp). Every rank must therefore run its MoE layers in
the same steps as the others, so the cores step in lockstep (engine/core_loop.py):

    each loop turn:  all-reduce (MAX) of [this core has work, this core is stopping]
      nobody has work     -> every core idles (waits for messages), then asks again
      somebody has work   -> a core with work steps; a core without (or whose scheduler
                             granted nothing) runs a dummy pass: each MoE layer with no
                             tokens of its own, which still computes its experts for the
                             others' tokens (vLLM's idle DP ranks run a dummy batch)
      somebody stopping   -> every core stops (a shutdown reaches them one by one; none is
                             left waiting in a collective for one that is gone)

Attention and the KV pool stay each core's own: only the MoE layers talk.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

STARTUP_TIMEOUT = datetime.timedelta(minutes=15)


def init_dp_group(config) -> None:
    """Join the cores' process group (the DP client chose the loopback port)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config.data_parallel_master_port}",
                            rank=config.data_parallel_rank, world_size=config.data_parallel_size,
                            timeout=STARTUP_TIMEOUT)


class DPLockstep:
    """What the engine-core loop needs to keep its model in step with the other cores'."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def agree(self, has_work: bool, stopping: bool) -> tuple[bool, bool]:
        """(does any core have work, is any core stopping)."""
        from pagedserve.model.parallel import comm_observer

        flags = torch.tensor([int(has_work), int(stopping)], dtype=torch.int64)
        observer = comm_observer()
        t0 = time.perf_counter()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if observer is not None and flags[0]:  # a turn with work (idle turns wait for messages, not the link)
            observer.record("dp_sync", time.perf_counter() - t0, flags.numel() * flags.element_size())
        return bool(flags[0]), bool(flags[1])

    @property
    def num_forwards(self) -> int:
        return self.runner.num_forwards

    def dummy_step(self) -> None:
        self.runner.dummy_moe_pass()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
