"""The engine core's seams: the KV manager changes nothing when it refuses, executors keep
the Executor protocol, and the output path costs the same at every output length."""
from __future__ import annotations

import json
import random
import shutil
import tracemalloc
from pathlib import Path

import pytest

from pagedserve.config import EngineConfig
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.executor import Executor
from pagedserve.core.kv_cache import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.sampling import SamplingParams
from pagedserve.sim.instant_executor import InstantExecutor


def kv_state(kv: KVCacheManager) -> tuple:
    """Everything a refused call must leave as it was."""
    pool = kv.pool
    host = kv.host_pool
    return ([b.block_id for b in pool.free_queue], [b.ref_cnt for b in pool.blocks],
            {h: b.block_id for h, b in pool.hash_to_block.items()},
            {rid: [b.block_id for b in t] for rid, t in kv.block_tables.items()},
            {rid: [b.block_id for b in t] for rid, t in kv.host_tables.items()},
            None if host is None else [b.block_id for b in host.free_queue])


def test_allocate_with_prefix_hits_changes_nothing_when_it_fails():
    """Reviving cached blocks takes them off the free queue: when hits plus new blocks do not
    fit, nothing is touched (no half-adopted prefix, no ref counts moved)."""
    kv = KVCacheManager(BlockPool(5, enable_caching=True), block_size=2)
    first = Request("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams())
    assert kv.allocate_slots(first, 7) is not None          # 4 blocks
    kv.cache_blocks(first, 7)                                 # 3 full blocks published
    kv.free(first)                                            # all free again, 3 still cached
    hog = Request("hog", [9, 9, 9], SamplingParams())
    assert kv.allocate_slots(hog, 3) is not None             # takes the 2 uncached blocks
    second = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], SamplingParams())
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert hits and num_hit_tokens == 2 * len(hits)
    before = kv_state(kv)
    # hits need reviving and the rest of the prompt needs new blocks: more than the 3 free
    assert kv.allocate_slots(second, second.num_tokens - num_hit_tokens, num_hit_tokens, hits) is None
    assert kv_state(kv) == before
    assert second.num_computed_tokens == 0  # the request itself was never touched either


def test_swap_in_changes_nothing_when_it_fails():
    kv = KVCacheManager(BlockPool(4), block_size=2, host_pool=BlockPool(4))
    victim = Request("v", [1, 2, 3, 4, 5], SamplingParams())
    assert kv.allocate_slots(victim, 5) is not None
    victim.num_computed_tokens = 5
    pairs = kv.swap_out(victim)
    assert len(pairs) == 3 and kv.num_free_blocks == 4
    other = Request("o", [1, 2, 3], SamplingParams())
    assert kv.allocate_slots(other, 3) is not None           # 2 blocks: 2 left, victim needs 3
    before = kv_state(kv)
    assert kv.swap_in(victim, 1) is None
    assert kv_state(kv) == before
    kv.free(other)
    assert len(kv.swap_in(victim, 1)) == 3
    kv.free(victim)
    assert kv.num_free_blocks == 4 and kv.host_pool.num_free_blocks == 4


def test_executors_keep_the_protocol(tiny_llama):
    """A renamed executor method fails here, not silently at run time."""
    from pagedserve.model.loader import read_model_config
    from pagedserve.sim.executor import SimExecutor
    from pagedserve.worker.model_runner import ModelRunner

    runner = ModelRunner(read_model_config(tiny_llama), "float32", "cpu", 16, frozenset(), 0)
    for executor in (runner, SimExecutor(cost_model=None), InstantExecutor(4096)):
        assert isinstance(executor, Executor)
        # In one process there are no ranks: nothing that can die, no other processes to report.
        assert executor.check_health() is None and executor.worker_pids() == []
        assert executor.dp_lockstep is None   # only a DP attention + EP core's runner steps in lockstep


@pytest.fixture
def long_model_dir(tmp_path) -> Path:
    """The built-in model's config and tokenizer, allowed 4k positions (no weights needed)."""
    from pagedserve.default_model_path import DEFAULT_MODEL_DIR

    for f in Path(DEFAULT_MODEL_DIR).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("with_stop", [False, True])
def test_step_memory_traffic_is_flat_in_output_length(long_model_dir, with_stop):
    """The output path hands out deltas: a step's transient allocations at the 1,400th token
    equal those at the 100th (the old path copied every request's whole output each step,
    and searched its whole text for stop strings). Bytes allocated, not seconds: no timing."""
    from pagedserve.engine import Engine
    from pagedserve.engine.output_processor import OutputKind

    engine = Engine(EngineConfig(model=str(long_model_dir), max_num_seqs=4, num_kv_blocks=4 * 100,
                                 max_model_len=1600, enable_prefix_caching=False, preemption_mode="recompute"),
                    executor=InstantExecutor(4096))
    params = SamplingParams(max_tokens=1500, ignore_eos=True, stop=["\x00never\x00"] if with_stop else None)
    rng = random.Random(1)
    for i in range(4):
        engine.add_request(f"r{i}", [rng.randrange(16, 4096) for _ in range(16)], params,
                           output_kind=OutputKind.DELTA)

    def step_peak() -> int:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        outputs = engine.step()
        _, peak = tracemalloc.get_traced_memory()
        assert all(len(c.token_ids) <= 1 for o in outputs for c in o.outputs)  # deltas, not histories
        return peak - base

    tracemalloc.start()
    try:
        peaks: dict[int, list[int]] = {}
        step = 0
        while engine.has_unfinished_requests():
            step += 1
            peak = step_peak()
            if 100 <= step < 140 or 1400 <= step < 1440:
                peaks.setdefault(step // 1000, []).append(peak)
    finally:
        tracemalloc.stop()
    early, late = sorted(peaks[0])[len(peaks[0]) // 2], sorted(peaks[1])[len(peaks[1]) // 2]
    assert late < 1.3 * early + 2048, (early, late)
