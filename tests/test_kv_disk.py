"""The disk KV tier (--kv-offloading-disk PATH --kv-offloading-disk-size GiB): blocks the host
tier evicts are written to slot files under PATH and read back (through the host tier) on a
later hit; the files outlive the server. The reference is HF transformers' greedy output on
the same weights: the disk tier, a restart on its files, corrupted files and a failing disk
all leave the tokens HF's.
"""
from __future__ import annotations

import logging
import os
import random

import pytest

from checkpoints import HFGreedyReference, config_from_flags
from pagedserve.core.kv_disk import DiskEntry, DiskTier, check_disk_fits, rank_file_name
from pagedserve.core.kv_events import BlockRemoved, BlockStored
from pagedserve.sampling import SamplingParams

BYTES_PER_BLOCK = 16 * 2 * 2 * 2 * 16 * 4  # the tiny llama: tokens x layers x K/V x kv heads x head dim x fp32
MAX_TOKENS = 5


def gib(num_blocks: int) -> float:
    return num_blocks * BYTES_PER_BLOCK / 2**30


def disk_llm(model, path, **overrides):
    """A pool of 12 blocks, a host tier of 2 (it evicts at once), a disk tier of 64."""
    from pagedserve import LLM

    knobs = dict(num_kv_blocks=12, max_model_len=192, max_num_seqs=4, preemption_mode="swap", swap_space="1MiB",
                 kv_offloading_size=gib(2), kv_offloading_disk=str(path), kv_offloading_disk_size=gib(64))
    knobs.update(overrides)
    return LLM(str(model), **knobs)


def chats(llm, turns: int = 3, seed: int = 0):
    """Four chats at once, `turns` turns each (histories outgrow the pool and the host tier)."""
    rng = random.Random(seed)
    histories = [[rng.randrange(5, 380) for _ in range(rng.randrange(30, 50))] for _ in range(4)]
    prompts, outputs = [], []
    for _ in range(turns):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        for h, r in zip(histories, llm.generate([list(h) for h in histories], params, use_tqdm=False)):
            prompts.append(list(h))
            outputs.append(r.outputs[0].token_ids)
            h.extend(r.outputs[0].token_ids + [rng.randrange(5, 380) for _ in range(20)])
    pool = llm.engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    return prompts, outputs


@pytest.fixture(scope="module")
def hf_reference(tiny_llama):
    return HFGreedyReference(tiny_llama)


@pytest.fixture(scope="module")
def first_run(tiny_llama, hf_reference, tmp_path_factory):
    """One server's life on a fresh disk tier: its tokens (checked against HF) and its files."""
    path = tmp_path_factory.mktemp("disk_tier")
    with disk_llm(tiny_llama, path) as llm:
        assert llm.engine.engine_core.pool.bytes_per_block == BYTES_PER_BLOCK
        prompts, outputs = chats(llm)
        disk = llm.engine.engine_core.scheduler.kv.disk
        counters = disk.counters
        kept = disk.num_blocks
    hf_reference.assert_greedy(prompts, outputs, [MAX_TOKENS] * len(outputs), "disk tier: ")
    return path, prompts, outputs, counters, kept


def test_greedy_text_equals_hf_through_the_disk_tier(first_run):
    _, _, _, counters, kept = first_run
    assert counters.stored > 0 and counters.loaded > 0 and counters.refused == 0 and kept > 0


def copy_files(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())


def test_a_restarted_server_starts_warm_on_the_same_files(tiny_llama, first_run, tmp_path):
    path, prompts, outputs, _, kept = first_run
    copy_files(path, tmp_path)  # the other tests get the first run's files untouched
    with disk_llm(tiny_llama, tmp_path) as llm:
        disk = llm.engine.engine_core.scheduler.kv.disk
        assert disk.num_blocks == kept
        again = chats(llm)
        assert disk.counters.loaded > 0 and disk.counters.refused == 0
    assert again == (prompts, outputs)


def test_corrupted_blocks_are_missed_and_computed_again(tiny_llama, first_run, tmp_path):
    """Flip bytes in every slot's payload: the checksum refuses each, tokens stay HF's."""
    path, prompts, outputs, _, kept = first_run
    copy_files(path, tmp_path)
    name = os.path.join(tmp_path, rank_file_name(0, 0))
    data = bytearray(open(name, "rb").read())
    slot = 64 + BYTES_PER_BLOCK
    for start in range(0, len(data), slot):
        data[start + 64 + 100] ^= 0xFF
    open(name, "wb").write(bytes(data))
    with disk_llm(tiny_llama, tmp_path) as llm:
        disk = llm.engine.engine_core.scheduler.kv.disk
        assert disk.num_blocks == kept
        again = chats(llm)
        assert disk.counters.refused > 0
    assert again == (prompts, outputs)


def test_a_disk_that_fails_mid_run_drops_to_the_tiers_above(tiny_llama, first_run, tmp_path, monkeypatch, caplog):
    from pagedserve.worker import disk_store

    _, prompts, outputs, _, _ = first_run
    real_write, calls = disk_store.DiskStore.write, []

    def failing_write(self, blocks, sync=True):
        calls.append(len(blocks))
        if len(calls) > 1:
            raise OSError(5, "Input/output error")
        real_write(self, blocks, sync)

    monkeypatch.setattr(disk_store.DiskStore, "write", failing_write)
    with caplog.at_level(logging.WARNING, logger="pagedserve.core.kv_disk"):
        with disk_llm(tiny_llama, tmp_path) as llm:
            again = chats(llm)
            disk = llm.engine.engine_core.scheduler.kv.disk
            assert not disk.enabled and disk.num_blocks == 0
    lines = [r for r in caplog.records if r.name == "pagedserve.core.kv_disk"]
    assert len(lines) == 1 and "Input/output error" in lines[0].getMessage() and len(calls) == 2
    assert again == (prompts, outputs)


def test_files_of_another_model_or_layout_are_refused(tmp_path):
    fingerprint = {"model": "/m/a", "model_config_sha256": "ab", "dtype": "float32", "kv_cache_dtype": "float32",
                   "block_size": 16, "bytes_per_block": 8192, "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    DiskTier(str(tmp_path), 8, 16, fingerprint).close()
    DiskTier(str(tmp_path), 8, 16, fingerprint).close()  # the same one reopens
    for field, other in (("model", "/m/b"), ("kv_cache_dtype", "fp8_e4m3"), ("tensor_parallel_size", 2),
                         ("block_size", 32)):
        with pytest.raises(ValueError, match=f"another model or layout.*{field}"):
            DiskTier(str(tmp_path), 8, 16, dict(fingerprint, **{field: other}))


def test_a_directory_in_use_by_a_running_engine_is_refused(tmp_path):
    fingerprint = {"model": "/m/a"}
    first = DiskTier(str(tmp_path), 8, 16, fingerprint)
    with pytest.raises(ValueError, match="in use by another running engine"):
        DiskTier(str(tmp_path), 8, 16, fingerprint)
    first.close()
    DiskTier(str(tmp_path), 8, 16, fingerprint).close()


def test_a_torn_last_index_record_is_ignored(tmp_path):
    """A server killed while appending a record: the records before it stand, the torn one
    (its slot's bytes were fsynced, but no record names them) is simply not there."""
    fingerprint = {"model": "/m/a"}
    tier = DiskTier(str(tmp_path), 8, 16, fingerprint)
    tier._append([DiskTier._put_record(DiskEntry(3, b"k" * 32, None, b"c"))])
    tier.close()
    with open(tmp_path / "index.jsonl", "a") as f:
        f.write('{"op": "put", "slot": 5, "key": "6b6b')
    tier = DiskTier(str(tmp_path), 8, 16, fingerprint)
    assert list(tier.entries) == [b"k" * 32] and tier.entries[b"k" * 32].slot == 3 and 5 in tier._free_slots
    tier.close()


def test_a_slot_is_recorded_only_after_the_ranks_fsynced_it(tmp_path, monkeypatch):
    from pagedserve.core import kv_disk
    from pagedserve.core.block_pool import KVBlock

    monkeypatch.setattr(kv_disk, "SYNC_INTERVAL_S", 3600.0)  # no sync due
    tier = DiskTier(str(tmp_path), 8, 16, {"model": "/m/a"})
    assert tier.spill(KVBlock(0), b"k" * 32, None, b"c")
    writes, _, sync = tier.take_copies()
    assert len(writes) == 1 and not sync
    tier.finish_step("", [])  # written, not fsynced: no record yet
    assert len((tmp_path / "index.jsonl").read_text().splitlines()) == 1 and tier.needs_sync
    monkeypatch.setattr(kv_disk, "SYNC_INTERVAL_S", 0.0)
    assert tier.take_copies()[2]  # the next step fsyncs, then the record follows
    tier.finish_step("", [])
    assert '"slot": ' in (tmp_path / "index.jsonl").read_text().splitlines()[1] and not tier.needs_sync
    tier.close()


def test_an_engine_with_another_kv_dtype_refuses_the_files(tiny_llama, first_run, tmp_path):
    path, *_ = first_run
    copy_files(path, tmp_path)
    with pytest.raises(ValueError, match="kv_offloading_disk: .* another model or layout.*bytes_per_block"):
        disk_llm(tiny_llama, tmp_path, kv_cache_dtype="fp8")


def test_a_tier_larger_than_the_free_disk_is_refused_with_the_numbers(tmp_path):
    with pytest.raises(ValueError, match=r"needs 2\.00 GiB .* has only 1\.00 GiB free"):
        check_disk_fits(str(tmp_path), 2.0, 2 * 2**30 // 8192, 8192, 1, free=2**30)


def replay(cached: set[int], events) -> None:
    for e in events:
        if isinstance(e, BlockStored):
            cached.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            cached.difference_update(e.block_hashes)
        else:
            cached.clear()


def test_events_rebuild_pool_host_and_disk_after_every_step(tiny_llama, first_run, tmp_path):
    """Events replayed after each step give exactly what the pool and both tiers can serve,
    from the start on a restarted tier's files (announced as DISK)."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine import Engine

    path, prompts, *_ = first_run
    copy_files(path, tmp_path)
    engine = Engine(EngineConfig(model=str(tiny_llama), num_kv_blocks=12, max_model_len=192, max_num_seqs=4,
                                 preemption_mode="swap", swap_space="1MiB", kv_offloading_size=gib(2),
                                 kv_offloading_disk=str(tmp_path), kv_offloading_disk_size=gib(64)))
    core = engine.engine_core
    core.record_kv_events()
    cached: set[int] = set()
    media: set[str] = set()
    replay(cached, core.take_kv_events())  # what the first run left, before any step
    assert cached == core.cached_block_hashes() and len(cached) == core.scheduler.kv.disk.num_blocks > 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        if i % 4 != 3:
            continue
        while engine.has_unfinished_requests():
            engine.step()
            events = core.take_kv_events()
            media.update(e.medium for e in events if isinstance(e, (BlockStored, BlockRemoved)))
            replay(cached, events)
            assert cached == core.cached_block_hashes()
    disk = core.scheduler.kv.disk
    assert disk.counters.loaded > 0 and disk.counters.stored > 0 and {"CPU", "DISK"} <= media
    core.shutdown()


@pytest.mark.parametrize("knobs, field", [
    (dict(kv_offloading_size=1, kv_offloading_disk="/tmp/x"), "kv_offloading_disk_size"),
    (dict(kv_offloading_size=1, kv_offloading_disk_size=1), "kv_offloading_disk"),
    (dict(kv_offloading_size=1, kv_offloading_disk="/tmp/x", kv_offloading_disk_size=-2), "kv_offloading_disk_size"),
    (dict(kv_offloading_disk="/tmp/x", kv_offloading_disk_size=1), "kv_offloading_disk"),
    (dict(kv_offloading_size=1, kv_offloading_disk="/tmp/x", kv_offloading_disk_size=1, tensor_parallel_size=2),
     "kv_offloading_disk"),
])
def test_bad_disk_tier_settings_are_refused_by_name(knobs, field):
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(**knobs)


def test_the_disk_flags_parse():
    config = config_from_flags(["--kv-offloading-size", "0.5", "--kv-offloading-disk", "/tmp/kv",
                                "--kv-offloading-disk-size", "8"])
    assert (config.kv_offloading_disk, config.kv_offloading_disk_size) == ("/tmp/kv", 8.0)
