"""Scheduling policy decisions, torch-free, through the scheduler's public surface
(`Scheduler.from_config`, `add_request`, `schedule()`): which request a priority policy
admits first, which one it preempts, and which mode `auto` preemption picks when the
costs say swap or recompute. Expected decisions are worked out by hand in each test."""
from __future__ import annotations

import pytest

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import StepResult
from pagedserve.core.scheduler import PreemptionCosts, Scheduler
from pagedserve.core.request import Request, RequestStatus
from pagedserve.sampling import SamplingParams

BLOCK = 4


def make_scheduler(num_blocks: int, *, num_host_blocks: int = 0, costs: PreemptionCosts | None = None,
                   max_model_len: int = 64, **knobs) -> Scheduler:
    config = EngineConfig(block_size=BLOCK, max_model_len=max_model_len, enable_prefix_caching=False, **knobs)
    config.resolve(max_model_len)
    return Scheduler.from_config(config, num_blocks, clock=lambda: 0.0, num_host_blocks=num_host_blocks,
                                 costs=costs)


def add(sched: Scheduler, rid: str, num_prompt: int, arrival: float, priority: int = 0) -> None:
    sched.add_request(Request(rid, list(range(2, 2 + num_prompt)), SamplingParams(max_tokens=20, ignore_eos=True),
                              arrival_time=arrival, priority=priority, max_model_len=64))


def step(sched: Scheduler, token: int = 7):
    """One scheduling step, then every request that reached its end samples `token`.
    (The one place that knows how the executor's result is handed back.)"""
    out = sched.schedule()
    sched.update_from_output(out, StepResult({r.request_id: token for r in out.scheduled if r.sample}))
    return out


def test_priority_admits_by_priority_then_arrival():
    # Arrival order a, b, c, d; priorities 3, 1, 2, 1 (lower runs first, as vLLM).
    for policy, admitted in (("priority", ["b", "d"]), ("fcfs", ["a", "b"])):
        sched = make_scheduler(64, max_num_seqs=2, scheduling_policy=policy)
        for t, (rid, prio) in enumerate([("a", 3), ("b", 1), ("c", 2), ("d", 1)]):
            add(sched, rid, 5, arrival=float(t), priority=prio)
        out = step(sched)
        assert [r.request_id for r in out.scheduled] == admitted, policy
        # The next free seat goes to the best waiting request: finish one and look.
        # priority: c (2) before a (3) although a came first; fcfs: c is simply next.
        sched.finish_request(admitted[0], RequestStatus.FINISHED_ABORTED)
        out = step(sched)
        assert [r.request_id for r in out.scheduled if r.start_pos == 0] == ["c"], policy


@pytest.mark.parametrize("policy,victim", [("priority", "old_low"), ("fcfs", "new_high")])
def test_victim_is_the_lowest_priority_then_latest_arrival(policy, victim):
    """Three prompts of 8 tokens fill a 6-block pool (2 blocks each). Their first sampled token
    needs a third block each: someone must go. Priority preempts the worst priority even
    though it arrived first; FCFS preempts the latest arrival."""
    sched = make_scheduler(6, scheduling_policy=policy)
    add(sched, "old_low", 8, arrival=0.0, priority=2)
    add(sched, "mid", 8, arrival=1.0, priority=1)
    add(sched, "new_high", 8, arrival=2.0, priority=0)
    first = step(sched)
    assert sorted(r.request_id for r in first.scheduled) == ["mid", "new_high", "old_low"]
    assert first.stats.num_used_blocks == 6 and not first.preempted_ids
    second = step(sched)
    assert second.preempted_ids == [victim]
    assert sorted(r.request_id for r in second.scheduled) == sorted({"old_low", "mid", "new_high"} - {victim})


def swapping_scheduler(costs: PreemptionCosts) -> Scheduler:
    """A 6-block pool, host room for all, mode auto; after two steps 'c' (latest) is the victim
    with 2 blocks and 8 computed tokens."""
    sched = make_scheduler(6, num_host_blocks=16, costs=costs, preemption_mode="auto")
    for t, rid in enumerate("abc"):
        add(sched, rid, 8, arrival=float(t))
    step(sched)
    return sched


# swap moves 2 blocks out and back in: 2 x 2 x 1000 bytes / bandwidth; recompute redoes 8 tokens.
@pytest.mark.parametrize("bandwidth,per_token,mode", [
    (1e12, 1.0, "swap"),         # a fast host link: swap
    (1e-3, 1e-12, "recompute"),  # a slow host link, free prefill: recompute
    (1000.0, 0.5, "swap"),       # 4 s each way: a tie goes to swap
    (1000.0, 0.49, "recompute"), # recompute 3.92 s < swap 4 s
])
def test_auto_mode_follows_the_costs(bandwidth, per_token, mode):
    sched = swapping_scheduler(PreemptionCosts(bytes_per_block=1000, host_bandwidth=bandwidth,
                                               prefill_seconds_per_token=per_token))
    out = step(sched)
    assert out.preempted_ids == ["c"]
    assert out.stats.num_preempted == {mode: 1}
    if mode == "swap":
        assert len(out.blocks_to_swap_out) == 2 and out.stats.num_blocks_swapped_out == 2
        assert out.stats.num_recomputed_tokens == 0 and out.stats.num_swapped == 1
    else:
        assert out.blocks_to_swap_out == [] and out.stats.num_recomputed_tokens == 8
        assert out.stats.num_swapped == 0


def test_last_prompt_chunk_beside_decodes_gets_only_the_leftover_budget():
    """Two decodes and a prompt whose last chunk (32 tokens) would fit an empty step's budget (32)
    but not what the decodes leave (30): it gets 30, the step computes exactly 32 tokens, and the
    2 left over come the step after. (Granting the chunk in full would make a 34-token step.)"""
    sched = make_scheduler(64, max_model_len=128, max_num_batched_tokens=32)
    for t, (rid, n) in enumerate([("d1", 4), ("d2", 4), ("p", 56)]):
        sched.add_request(Request(rid, list(range(2, 2 + n)), SamplingParams(max_tokens=20, ignore_eos=True),
                                  arrival_time=float(t), max_model_len=128))
    first = step(sched)  # d1 and d2 prefill 4 each, p's first chunk takes the remaining 24
    assert [(r.request_id, r.num_new_tokens) for r in first.scheduled] == [("d1", 4), ("d2", 4), ("p", 24)]
    second = step(sched)
    assert [(r.request_id, r.start_pos, r.num_new_tokens) for r in second.scheduled] == \
        [("d1", 4, 1), ("d2", 4, 1), ("p", 24, 30)]
    assert second.num_batched_tokens == 32 == second.stats.num_batched_tokens
    assert not second.scheduled[2].sample  # p's prompt is not done: nothing sampled for it yet
    assert second.stats.num_decode_tokens == 2 and second.stats.num_prefill_tokens == 30
    third = step(sched)
    assert [(r.request_id, r.num_new_tokens, r.sample) for r in third.scheduled] == \
        [("d1", 1, True), ("d2", 1, True), ("p", 2, True)]
    assert third.num_batched_tokens == 4
