"""Property test: random add / step / abort interleavings keep the block invariants.

Drives the torch-free core directly with a fake executor (random sampled tokens). The
examples must exercise the mechanisms whose invariants they check: the test counts the
preemptions (each mode), swap-ins and prefix-cache hits over all examples, and fails if
any of them never happened. Examples: ~100 by default, 400 with
`--hypothesis-profile thorough` (see conftest.py).
"""
from __future__ import annotations

import collections
import random

from hypothesis import event, given, target
from hypothesis import strategies as st

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache import KVCacheManager, cdiv
from pagedserve.core.scheduler import PreemptionCosts, Scheduler, SchedulerConfig
from pagedserve.core.outputs import StepResult
from pagedserve.core.request import Request, RequestStatus
from pagedserve.sampling import SamplingParams

EOS = 0


def check_invariants(sched: Scheduler, pool: BlockPool, out=None) -> None:
    kv = sched.kv
    # Ref counts equal the number of block tables holding each block.
    refs = [0] * pool.num_blocks
    for table in kv.block_tables.values():
        assert len(set(b.block_id for b in table)) == len(table), "a table holds a block twice"
        for b in table:
            refs[b.block_id] += 1
    for b in pool.blocks:
        assert b.ref_cnt == refs[b.block_id], f"{b} has {refs[b.block_id]} table references"
    # Free queue holds exactly the unreferenced blocks.
    free_ids = [b.block_id for b in pool.free_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    # Cached hashes point at blocks that carry that hash.
    for h, b in pool.hash_to_block.items():
        assert b.block_hash == h
    # Host pool: swapped requests (and only they) hold host blocks, one per computed block.
    host = kv.host_pool
    if host is not None:
        held = [b for t in kv.host_tables.values() for b in t]
        assert len(held) == len({b.block_id for b in held})
        assert host.num_used_blocks == len(held)
        assert all(b.ref_cnt == 1 for b in held)
        assert set(kv.host_tables) == {r.request_id for r in sched.swapped}
        for r in sched.swapped:
            assert r.status == RequestStatus.SWAPPED and r.request_id not in kv.block_tables
            assert len(kv.host_tables[r.request_id]) == cdiv(r.num_computed_tokens, kv.block_size)
    else:
        assert not sched.swapped
    # Only running requests hold blocks, and no more than their tokens need.
    for rid, table in kv.block_tables.items():
        req = sched.requests[rid]
        assert req.status == RequestStatus.RUNNING
        assert len(table) <= cdiv(req.num_tokens, kv.block_size)
    assert len(sched.running) <= sched.config.max_num_seqs
    if out is not None:
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert sum(r.num_new_tokens for r in out.scheduled) == out.num_batched_tokens
        assert len(out.scheduled) <= sched.config.max_num_seqs
        for r in out.scheduled:
            assert kv.num_blocks_held(r.request_id) >= cdiv(r.context_len, kv.block_size)


ops = st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "abort"]),
                         st.integers(1, 120), st.integers(1, 80), st.integers(0, 10**6)),
               min_size=20, max_size=80)


# What the examples exercised, summed over one run of the property (see the test below).
SEEN: collections.Counter = collections.Counter()


def record_mechanisms(sched: Scheduler) -> None:
    seen = {"recompute preemptions": sched.total_preemptions_by_mode["recompute"],
            "swap preemptions": sched.total_preemptions_by_mode["swap"],
            "blocks swapped in": sched.total_blocks_swapped["in"],
            "prefix-cache hit tokens": sched.kv.prefix_hits,
            "partial prefills": sched.total_partial_prefills}
    for name, count in seen.items():
        SEEN[name] += count
        if count:
            event(f"had {name}")
    target(float(sched.total_preemptions), label="preemptions")


@given(ops=ops, num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 4, 16]),
       budget=st.integers(8, 256), max_seqs=st.integers(1, 8), chunked=st.booleans(),
       caching=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
       mode=st.sampled_from(["recompute", "swap", "auto"]), host_blocks=st.integers(0, 30),
       prefill_cost=st.sampled_from([1e-9, 1e-3]))
def random_interleavings_keep_invariants(ops, num_blocks, block_size, budget, max_seqs, chunked, caching, policy,
                                         mode, host_blocks, prefill_cost):
    max_model_len = num_blocks * block_size
    if not chunked:
        budget = max(budget, max_model_len)
    pool = BlockPool(num_blocks, enable_caching=caching)
    host = BlockPool(host_blocks) if host_blocks and mode != "recompute" else None
    costs = PreemptionCosts(bytes_per_block=1000, host_bandwidth=1e9, prefill_seconds_per_token=prefill_cost)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                      max_model_len=max_model_len, enable_chunked_prefill=chunked,
                                      scheduling_policy=policy, preemption_mode=mode),
                      KVCacheManager(pool, block_size, host), costs=costs)
    rng = random.Random(0)
    next_id = 0
    shared_prefix = [7] * 40  # lets prefix caching find hits
    for op, a, b, seed in ops:
        if op == "add":
            n = min(a, max_model_len - 1)
            prompt = (shared_prefix + [rng.randrange(1, 50) for _ in range(n)])[:n] if seed % 2 else \
                [rng.randrange(1, 50) for _ in range(n)]
            req = Request(f"r{next_id}", prompt, SamplingParams(max_tokens=b, ignore_eos=bool(seed % 3)),
                          frozenset({EOS}), arrival_time=float(next_id), priority=seed % 4,
                          max_model_len=max_model_len)
            next_id += 1
            sched.add_request(req)
        elif op == "abort" and sched.requests:
            victim = sorted(sched.requests)[seed % len(sched.requests)]
            sched.finish_request(victim, RequestStatus.FINISHED_ABORTED)
        else:
            out = sched.schedule()
            check_invariants(sched, pool, out)
            sampled = {r.request_id: rng.choice([EOS, 3, 5, 8]) for r in out.scheduled if r.sample}
            sched.update_from_output(out, StepResult(sampled))
        check_invariants(sched, pool)
    # Drain: everything must finish (no request stuck) and every block come back.
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_invariants(sched, pool, out)
        assert out.scheduled, "requests remain but nothing could be scheduled"
        sched.update_from_output(out, StepResult({r.request_id: 3 for r in out.scheduled if r.sample}))
    assert not sched.has_unfinished()
    assert pool.num_free_blocks == pool.num_blocks
    assert not sched.kv.block_tables
    if host is not None:
        assert host.num_free_blocks == host.num_blocks and not sched.kv.host_tables
    record_mechanisms(sched)


def test_random_interleavings_keep_invariants():
    """Runs the property, then checks that its examples really preempted (both modes), swapped
    blocks back in, chunked prompts and hit the prefix cache: invariants kept by examples that
    never reached a mechanism would prove nothing about it."""
    SEEN.clear()
    random_interleavings_keep_invariants()
    missing = [name for name in ("recompute preemptions", "swap preemptions", "blocks swapped in",
                                 "prefix-cache hit tokens", "partial prefills") if SEEN[name] == 0]
    assert not missing, f"no example exercised: {missing} (seen: {dict(SEEN)})"
