"""The host swap pool reuses recently freed blocks first, so its resident memory stays at the
most blocks ever swapped out at once instead of growing to the whole --swap-space.

The pool's memory is mapped lazily (a page is resident once a block copy writes it), so the
set of host block ids ever written *is* what becomes resident: the asserts count ids, never
bytes or seconds."""
from __future__ import annotations

import random

from pagedserve.config import EngineConfig
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.outputs import StepResult
from pagedserve.default_model_path import DEFAULT_MODEL_DIR
from pagedserve.sampling import SamplingParams
from pagedserve.sim.instant_executor import InstantExecutor


class RecordingExecutor(InstantExecutor):
    """Samples random tokens, computes nothing, and records every swap the scheduler asks for."""

    def __init__(self, vocab: int) -> None:
        super().__init__(vocab)
        self.host_ids_written: set[int] = set()
        self.num_swaps_out = 0

    def execute(self, out) -> StepResult:
        if out.blocks_to_swap_out:
            self.num_swaps_out += 1
        self.host_ids_written.update(host for _, host in out.blocks_to_swap_out)
        return super().execute(out)


def test_many_swaps_touch_no_more_host_blocks_than_are_swapped_at_once():
    from pagedserve.engine import Engine

    executor = RecordingExecutor(4096)
    # 24 device blocks of 16 tokens for 6 requests that grow to 6 blocks each: swaps all along.
    # The host pool is the default 4 GiB swap space (thousands of blocks); the working set a few dozen.
    engine = Engine(EngineConfig(model=DEFAULT_MODEL_DIR, max_num_seqs=6, num_kv_blocks=24, max_model_len=128,
                                 enable_prefix_caching=False, preemption_mode="swap"),
                    executor=executor)
    host_pool = engine.engine_core.scheduler.kv.host_pool
    assert host_pool.num_blocks > 1000
    rng = random.Random(1)
    most_swapped_at_once = 0
    step = 0
    arrived = 0
    while arrived < 150 or engine.has_unfinished_requests():
        if arrived < 150 and step % 4 == 0:  # a steady stream of arrivals keeps the pool short
            params = SamplingParams(max_tokens=rng.randrange(40, 100), ignore_eos=True)
            engine.add_request(f"r{arrived}", [rng.randrange(16, 4096) for _ in range(12)], params)
            arrived += 1
        engine.step()
        step += 1
        most_swapped_at_once = max(most_swapped_at_once, host_pool.num_used_blocks)
    assert executor.num_swaps_out >= 40, executor.num_swaps_out  # the workload really swaps, over and over
    assert host_pool.num_free_blocks == host_pool.num_blocks  # every host block came back
    assert 0 < most_swapped_at_once < 100
    assert len(executor.host_ids_written) <= most_swapped_at_once, (
        len(executor.host_ids_written), most_swapped_at_once)
    assert max(executor.host_ids_written) < most_swapped_at_once  # the low end of the space, compactly


def test_reuse_recent_first_is_a_stack_starting_at_block_zero():
    pool = BlockPool(5, reuse_recent_first=True)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    pool.free(a)                                    # 0 then 1 on top
    assert [b.block_id for b in pool.allocate(3)] == [1, 0, 2]
    plain = BlockPool(5)
    first = plain.allocate(2)
    plain.free(first)
    assert [b.block_id for b in plain.allocate(3)] == [2, 3, 4]  # the device pool keeps LRU order


def test_start_up_log_says_what_swap_space_costs(caplog):
    from pagedserve.engine import Engine

    with caplog.at_level("INFO", logger="pagedserve.engine"):
        engine = Engine(EngineConfig(model=DEFAULT_MODEL_DIR, num_kv_blocks=24, max_model_len=128,
                                     preemption_mode="swap", swap_space="64MiB"), executor=RecordingExecutor(4096))
    pool = engine.engine_core.pool
    num_host = engine.engine_core.scheduler.kv.host_pool.num_blocks
    assert num_host == (64 << 20) // pool.bytes_per_block
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("swap space:"))
    assert f"{num_host:,} host blocks" in line and "reserved" in line
    assert "only the most blocks swapped out at once" in line
    assert "probe" not in line  # swap mode: no start-up bandwidth probe writes the pool


def test_plan_says_what_swap_space_costs(capsys):
    import json

    from pagedserve.plan.cli import main

    assert main(["--model", "llama-3.1-8b", "--device", "cpu", "--dtype", "bfloat16", "--kv-cache-memory", "8GiB",
                 "--swap-space", "1GiB"]) == 0
    text = capsys.readouterr().out
    # llama-3.1-8b in bf16: 8 KV heads x 128 x 2 (K, V) x 32 layers x 2 bytes = 128 KiB a token, 2 MiB a block
    assert "swap space: 512 host blocks x 2,048 KiB = 1.00 GiB reserved" in text
    assert main(["--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--json"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv"]
    assert kv["num_host_blocks"] == 2048 and kv["swap_space_resident_at_start"] == 4 << 30  # pinned on CUDA
    assert main(["--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--swap-space", "0"]) == 0
    assert "swap space" not in capsys.readouterr().out
