"""Property test: random add / step / abort interleavings keep the block invariants.

Drives the torch-free core directly with a fake executor (random sampled tokens). The
examples must exercise the mechanisms whose invariants they check: the test counts the
preemptions (each mode), swap-ins and prefix-cache hits over all examples, and fails if
any of them never happened. A second property aims at the token budget where prompt chunks share
a step with decodes, and fails if its examples never had a chunk capped by the decodes' share.
Examples: ~100 by default, 400 with `--hypothesis-profile thorough` (see conftest.py).
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


# -- the token budget when prompt chunks share a step with decodes ---------------------------------
# The property above draws budgets of 8-256 against a handful of requests: its examples rarely
# have decodes running while a prompt's *last* chunk would fit an empty step but not what the
# decodes leave, so a scheduler that granted that chunk in full (a 34-token step under a budget of
# 32) passed it. These strategies aim at that case: small budgets, many decoding requests, prompts
# a few budgets long arriving while they decode.
BUDGET_CASES: collections.Counter = collections.Counter()


def note_budget_cases(sched: Scheduler, out) -> None:
    """Count the chunks the decodes beside them left less than an empty step would grant, where
    that grant alone would have fit the full budget (the case a full grant overflows)."""
    decodes = [r for r in out.scheduled if r.num_new_tokens == 1 and r.sample
               and r.start_pos >= sched.requests[r.request_id].num_prompt_tokens]
    threshold = sched.config.long_prefill_token_threshold
    for r in out.scheduled:
        remaining = sched.requests[r.request_id].num_tokens - r.start_pos
        wanted = min(remaining, threshold) if threshold else remaining  # what an empty step would grant
        if decodes and r.num_new_tokens < wanted <= sched.config.max_num_batched_tokens:
            BUDGET_CASES["continued chunk capped beside decodes" if r.start_pos else
                         "first chunk capped beside decodes"] += 1
            event("a chunk capped by the decodes' share of the budget")


@given(budget=st.integers(2, 48), num_decoders=st.integers(1, 12), prompt_budgets=st.lists(
           st.floats(0.5, 4.0), min_size=1, max_size=4), arrivals=st.lists(st.integers(0, 6), min_size=4, max_size=4),
       block_size=st.sampled_from([1, 4, 16]), caching=st.booleans(), extra_blocks=st.integers(0, 40),
       threshold=st.sampled_from([0, 0, 0, 8, 20]))
def steps_with_decodes_and_prompt_chunks_keep_the_budget(budget, num_decoders, prompt_budgets, arrivals, block_size,
                                                         caching, extra_blocks, threshold):
    prompt_lens = [max(2, round(f * budget)) for f in prompt_budgets]
    decode_steps = 12
    max_model_len = max(prompt_lens) + decode_steps + 4
    # Room for every decoder and at least the longest prompt; `extra_blocks` short of all at once
    # lets some examples preempt as well.
    need = num_decoders * cdiv(2 + decode_steps, block_size) + cdiv(max_model_len, block_size)
    num_blocks = need + extra_blocks
    pool = BlockPool(num_blocks, enable_caching=caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_decoders + len(prompt_lens), max_num_batched_tokens=budget,
                                      max_model_len=max_model_len, long_prefill_token_threshold=threshold),
                      KVCacheManager(pool, block_size))
    params = SamplingParams(max_tokens=decode_steps, ignore_eos=True)
    for k in range(num_decoders):
        sched.add_request(Request(f"d{k}", [1 + k % 40, 2], params, frozenset({EOS}), arrival_time=float(k),
                                  max_model_len=max_model_len))
    pending = sorted(zip(arrivals, prompt_lens))
    for step_no in range(10_000):
        while pending and pending[0][0] <= step_no:
            _, n = pending.pop(0)
            rid = f"p{len(prompt_lens) - len(pending) - 1}"
            prompt = [3 + i % 45 for i in range(n)]
            sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True), frozenset({EOS}),
                                      arrival_time=100.0 + step_no, max_model_len=max_model_len))
        if not sched.has_unfinished() and not pending:
            break
        out = sched.schedule()
        check_invariants(sched, pool, out)
        for r in out.scheduled:  # nobody is granted more than it has left
            assert r.num_new_tokens <= sched.requests[r.request_id].num_tokens - r.start_pos
        note_budget_cases(sched, out)
        sched.update_from_output(out, StepResult({r.request_id: 3 for r in out.scheduled if r.sample}))
    assert not sched.has_unfinished() and not pending
    assert pool.num_free_blocks == pool.num_blocks


def test_steps_with_decodes_and_prompt_chunks_keep_the_budget():
    """Runs the budget property, then checks its examples did reach the case it is aimed at: a
    prompt chunk, continued or first, capped below its remainder by the decodes beside it."""
    BUDGET_CASES.clear()
    steps_with_decodes_and_prompt_chunks_keep_the_budget()
    missing = [name for name in ("continued chunk capped beside decodes", "first chunk capped beside decodes")
               if BUDGET_CASES[name] == 0]
    assert not missing, f"no example reached: {missing} (seen: {dict(BUDGET_CASES)})"
