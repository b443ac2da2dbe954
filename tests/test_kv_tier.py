"""The host KV tier (--kv-offloading-size): prefix blocks the device pool evicts are kept in
host memory and loaded back on a later hit instead of being computed again.

Two kinds of check:
- a slot-checking executor (no model) that keeps, for every device and host block slot, the
  token whose KV it holds, moves them exactly as the worker's swap copy moves KV (every
  device -> host copy, then every host -> device copy), and before each forward asserts that
  every position a request attends to holds that request's own token. It is the oracle for
  the scheduler, the tier and the copy ordering, independent of both;
- the real engine on a tiny checkpoint: greedy output equals HF transformers' (fp32) with the
  tier on, under forced preemption in each mode, and with fp8 KV equals the same engine
  without the tier.
"""
from __future__ import annotations

import random

import pytest

from checkpoints import HFGreedyReference, config_from_flags
from pagedserve.config import EngineConfig
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache import KVCacheManager
from pagedserve.core.kv_events import BlockRemoved, BlockStored, KVEventLog
from pagedserve.core.kv_tier import HostTier
from pagedserve.core.outputs import StepResult
from pagedserve.core.request import Request
from pagedserve.default_model_path import DEFAULT_MODEL_DIR
from pagedserve.sampling import SamplingParams
from pagedserve.sim.instant_executor import InstantExecutor

DEFAULT_MODEL_BYTES_PER_BLOCK = 65536  # the built-in model, 16-token blocks (asserted below)


def tier_gib(num_blocks: int, bytes_per_block: int = DEFAULT_MODEL_BYTES_PER_BLOCK) -> float:
    return num_blocks * bytes_per_block / 2**30


class SlotCheckingExecutor(InstantExecutor):
    """Tracks which token's KV each slot holds; fails the step that would read a wrong one.
    Samples a token that depends on the whole context as read from the slots, so a wrong
    slot would also change the output."""

    def __init__(self, block_size: int = 16) -> None:
        super().__init__(4096)
        self.bs = block_size
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.prefill_tokens = 0               # tokens computed that were not a decode
        self.sampled_by: dict[str, list[int]] = {}

    def execute(self, out) -> StepResult:
        for rid in out.finished_ids:
            self.tables.pop(rid, None)
            self.tokens.pop(rid, None)
        for data in out.new_requests:
            self.tokens[data.request_id] = list(data.prompt_token_ids)
        # One destination per copy list: two copies onto one block in a step would race
        # (index_copy_ with repeated indices keeps either).
        hosts_written = [h for _, h in out.blocks_to_swap_out]
        devices_written = [d for _, d in out.blocks_to_swap_in]
        assert len(set(hosts_written)) == len(hosts_written), f"host block written twice: {hosts_written}"
        assert len(set(devices_written)) == len(devices_written), f"device block written twice: {devices_written}"
        moved_out = {d: list(self.device.get(d, [None] * self.bs)) for d, _ in out.blocks_to_swap_out}
        for d, h in out.blocks_to_swap_out:
            self.host[h] = moved_out[d]
        moved_in = {h: list(self.host.get(h, [None] * self.bs)) for h, _ in out.blocks_to_swap_in}
        for h, d in out.blocks_to_swap_in:
            self.device[d] = moved_in[h]
        sampled = {}
        for sr in out.scheduled:
            table = self.tables.setdefault(sr.request_id, [])
            if sr.resumed:
                table[:] = sr.new_block_ids
            else:
                table.extend(sr.new_block_ids)
            tokens = self.tokens[sr.request_id]
            for p in range(sr.start_pos):
                held = self.device.get(table[p // self.bs], [None] * self.bs)[p % self.bs]
                assert held == tokens[p], (f"{sr.request_id}: position {p} of block {table[p // self.bs]} "
                                           f"holds {held}, want {tokens[p]}")
            for j, tok in enumerate(sr.token_ids):
                p = sr.start_pos + j
                self.device.setdefault(table[p // self.bs], [None] * self.bs)[p % self.bs] = tok
            if sr.num_new_tokens > 1 or sr.start_pos < len(tokens) - 1:
                self.prefill_tokens += sr.num_new_tokens
            if sr.sample:
                ctx = [self.device[table[p // self.bs]][p % self.bs] for p in range(sr.context_len)]
                tok = 16 + hash(tuple(ctx)) % 4000
                sampled[sr.request_id] = tok
                tokens.append(tok)
                self.sampled_by.setdefault(sr.request_id, []).append(tok)
        return StepResult(sampled=sampled)


def run_chats(config: EngineConfig, seed: int = 0, num_chats: int = 5, turns: int = 3, concurrent: int = 3,
              max_tokens: int = 6, executor: "SlotCheckingExecutor | None" = None):
    """Multi-turn chats (each turn: the previous prompt + its answer + a new question), a few at
    a time, through the engine on the slot-checking executor. Returns (executor, engine, outputs)."""
    from pagedserve.engine import Engine

    executor = executor or SlotCheckingExecutor(config.block_size)
    engine = Engine(config, executor=executor)
    sched = engine.engine_core.scheduler
    schedule, executor.evicted_hits = sched.schedule, 0

    def counting_schedule():
        out = schedule()
        executor.evicted_hits += out.stats.prefix_cache_evicted_hits
        return out
    sched.schedule = counting_schedule
    rng = random.Random(seed)
    histories = [[rng.randrange(16, 4000) for _ in range(rng.randrange(20, 40))] for _ in range(num_chats)]
    outputs, n = [], 0
    for _ in range(turns):
        for start in range(0, num_chats, concurrent):
            ids = []
            for h in histories[start:start + concurrent]:
                ids.append(f"r{n}")
                engine.add_request(f"r{n}", list(h), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                n += 1
            while engine.has_unfinished_requests():
                engine.step()
            for rid, h in zip(ids, histories[start:start + concurrent]):
                answer = executor.sampled_by[rid]
                assert len(answer) == max_tokens
                outputs.append(answer)
                h.extend(answer + [rng.randrange(16, 4000) for _ in range(20)])
    return executor, engine, outputs


def small_engine(**overrides) -> EngineConfig:
    """A pool of 12 blocks: the chats' histories outgrow it within a turn or two."""
    knobs = dict(model=DEFAULT_MODEL_DIR, num_kv_blocks=12, max_model_len=192, max_num_seqs=3, block_size=16,
                 swap_space="16MiB")  # 256 host blocks: the default 4 GiB would be 65,536 to set up
    knobs.update(overrides)
    return EngineConfig(**knobs)


def check_no_block_lost(engine) -> None:
    kv = engine.engine_core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    if kv.host_pool is not None:
        kv.begin_step()  # the last step's copies are done
        held = kv.tier.num_blocks if kv.tier is not None else 0
        assert kv.host_pool.num_used_blocks == held, (kv.host_pool.num_used_blocks, held)


# -- the tier's decisions, against the slot oracle --------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_multi_turn_chats_hit_the_tier_and_every_slot_read_is_right(mode):
    """A history that outgrew the pool comes back from the tier: loads happen, fewer prompt
    tokens are computed than without the tier, and every position every step attends to
    holds its own token (the oracle), with preemption in the mix."""
    base, on = (run_chats(small_engine(preemption_mode=mode, kv_offloading_size=size))
                for size in (None, tier_gib(64)))
    ex_off, eng_off, out_off = base
    ex_on, eng_on, out_on = on
    assert eng_on.engine_core.pool.bytes_per_block == DEFAULT_MODEL_BYTES_PER_BLOCK
    sched = eng_on.engine_core.scheduler
    assert sched.kv.tier.capacity == 64
    counters = sched.kv.tier.counters
    assert counters.loaded > 0 and counters.hits == counters.loaded
    assert ex_on.prefill_tokens < ex_off.prefill_tokens, (ex_on.prefill_tokens, ex_off.prefill_tokens)
    assert sched.total_preemptions > 0  # the pool is short: preemption is in the mix
    assert out_on == out_off
    check_no_block_lost(eng_on)
    check_no_block_lost(eng_off)
    # What `advise` reads: without the tier, returning histories missed on prefixes the pool had
    # evicted; the tier served most of those.
    assert ex_off.evicted_hits > 0 and ex_on.evicted_hits < ex_off.evicted_hits


def test_advise_suggests_a_tier_when_reused_prefixes_are_evicted():
    from pagedserve.bench.prom import parse_metrics
    from pagedserve.advise.advisor import Thresholds, advise, observe

    from test_advise import load_pair

    t = Thresholds()
    for tier_queries, direction in ((None, "add"), (500.0, "raise")):
        a, b = load_pair("balanced", "pagedserve")
        prompt = b.counters["prompt_tokens"] - a.counters["prompt_tokens"]
        a.counters["prefix_cache_evicted_hits"], b.counters["prefix_cache_evicted_hits"] = 0.0, 0.3 * prompt
        if tier_queries is not None:
            a.counters["external_prefix_cache_queries"] = 0.0
            b.counters["external_prefix_cache_queries"] = tier_queries
        report = advise(observe(a, b, [a, b], 30.0, t, gauges_sampled=False), t)
        assert [f.rule for f in report.findings] == ["evicted_prefixes"]
        finding = report.findings[0]
        assert (finding.knob, finding.direction) == ("kv_offloading_size", direction)
        assert "--kv-offloading-size" in finding.action and "30%" in finding.symptom
    a, b = load_pair("balanced", "pagedserve")  # below the share: nothing to say
    prompt = b.counters["prompt_tokens"] - a.counters["prompt_tokens"]
    a.counters["prefix_cache_evicted_hits"], b.counters["prefix_cache_evicted_hits"] = 0.0, 0.05 * prompt
    assert advise(observe(a, b, [a, b], 30.0, t, gauges_sampled=False), t).verdict == "balanced"


@pytest.mark.parametrize("seed", range(3))
def test_a_full_tier_evicts_and_never_fails_a_request(seed):
    """A tier of 3 blocks for chats that evict dozens: it evicts its oldest, keeps at most its
    capacity, every request finishes with the tokens the tier-less engine gives, and swap
    (sharing the host pool) still gets its blocks."""
    _, eng_off, out_off = run_chats(small_engine(preemption_mode="swap"), seed, concurrent=3)
    ex, eng, out = run_chats(small_engine(preemption_mode="swap", swap_space="2MiB",
                                          kv_offloading_size=tier_gib(3)), seed, concurrent=3)
    tier = eng.engine_core.scheduler.kv.tier
    assert tier.capacity == 3 and tier.num_blocks <= 3
    assert tier.counters.evicted > 0 and tier.counters.stored > 3
    assert out == out_off
    check_no_block_lost(eng)


@pytest.mark.parametrize("seed", range(4))
def test_churn_with_swap_and_a_tiny_tier_reads_every_slot_right(seed):
    """Arrivals between steps, shared stems, a 10-block pool, 3 tier blocks, swap preemption:
    swap-ins, loads, offloads and tier evictions meet in the same steps, where a host block
    reused before its copy ran (or written twice) would show in the slot oracle."""
    from pagedserve.engine import Engine

    config = small_engine(preemption_mode="swap", kv_offloading_size=tier_gib(3), swap_space="1MiB",
                          num_kv_blocks=10, max_num_seqs=4, max_model_len=160)
    engine = Engine(config, executor=SlotCheckingExecutor())
    rng = random.Random(seed)
    stems = [[rng.randrange(16, 4000) for _ in range(rng.randrange(16, 64))] for _ in range(4)]
    for i in range(60):
        engine.add_request(f"r{i}", rng.choice(stems) + [rng.randrange(16, 4000) for _ in range(rng.randrange(1, 40))],
                           SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True))
        for _ in range(rng.randrange(0, 4)):
            if engine.has_unfinished_requests():
                engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    sched = engine.engine_core.scheduler
    assert sched.total_preemptions_by_mode["swap"] > 0 and sched.kv.tier.counters.evicted > 0
    check_no_block_lost(engine)


def test_a_load_slower_than_the_prefill_it_saves_is_not_made():
    """The cost rule: with a host link this slow, computing the prefix again is cheaper, so the
    tier stores evicted blocks but the scheduler recomputes instead of loading them."""
    class SlowHostLink(SlotCheckingExecutor):
        def measure_host_bandwidth(self) -> float:
            return 1e3  # bytes/s: a 64 KiB block takes a minute; its 16 tokens 160 us to compute

    config = small_engine(preemption_mode="recompute", kv_offloading_size=tier_gib(64))
    _, fast, out_fast = run_chats(config)
    assert fast.engine_core.scheduler.kv.tier.counters.loaded > 0
    _, slow, out_slow = run_chats(small_engine(preemption_mode="recompute", kv_offloading_size=tier_gib(64)),
                                  executor=SlowHostLink())
    costs = slow.engine_core.scheduler.costs
    assert costs.load_seconds(1) > costs.recompute_seconds(16)
    tier = slow.engine_core.scheduler.kv.tier
    assert tier.counters.stored > 0 and tier.counters.hits == tier.counters.loaded == 0
    assert out_slow == out_fast


def test_swap_takes_the_tiers_blocks_when_the_host_pool_is_full():
    """No swap space at all: a swap-out finds the host pool held by the tier, which yields."""
    ex, eng, out = run_chats(small_engine(preemption_mode="swap", swap_space=0, kv_offloading_size=tier_gib(8)),
                             concurrent=3)
    sched = eng.engine_core.scheduler
    assert sched.total_preemptions_by_mode["swap"] > 0 and sched.kv.tier.counters.evicted > 0
    _, _, out_off = run_chats(small_engine(preemption_mode="swap", swap_space=0), concurrent=3)
    assert out == out_off
    check_no_block_lost(eng)


# -- KV events: one ordered stream for pool and tier -------------------------------------------
def replay(cached: set[int], events) -> None:
    for e in events:
        if isinstance(e, BlockStored):
            cached.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            cached.difference_update(e.block_hashes)
        else:
            cached.clear()


def test_events_rebuild_pool_and_tier_after_every_step():
    """With the tier on, the events (the tier's with medium "CPU") replayed after each step
    give exactly the keys the pool and the tier can serve, and the tier's events say CPU."""
    from pagedserve.engine import Engine

    config = small_engine(preemption_mode="swap", kv_offloading_size=tier_gib(6), device="cpu")
    executor = SlotCheckingExecutor()
    engine = Engine(config, executor=executor)
    core = engine.engine_core
    core.record_kv_events()
    rng = random.Random(3)
    stems = [[rng.randrange(16, 4000) for _ in range(40)] for _ in range(3)]
    cached: set[int] = set()
    media = set()
    for i in range(24):
        engine.add_request(f"r{i}", rng.choice(stems) + [rng.randrange(16, 4000) for _ in range(rng.randrange(1, 30))],
                           SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
            events = core.take_kv_events()
            media.update(e.medium for e in events if isinstance(e, (BlockStored, BlockRemoved)))
            replay(cached, events)
            assert cached == core.cached_block_hashes()
        if i == 16:
            assert engine.reset_prefix_cache()
            replay(cached, core.take_kv_events())
            assert cached == core.cached_block_hashes() == set()
    tier = core.scheduler.kv.tier
    assert tier.counters.loaded > 0 and tier.counters.evicted > 0 and media == {"CPU"}


def test_the_tier_names_its_events_cpu_beside_a_gpu_pool():
    """On a CUDA engine the pool's events say GPU; the tier's say CPU (vLLM's media)."""
    bs = 2
    pool = BlockPool(4, enable_caching=True)
    host = BlockPool(4, reuse_recent_first=True)
    tier = HostTier(host, 4, bs)
    pool.events = tier.events = KVEventLog(bs, "GPU")
    kv = KVCacheManager(pool, bs, host, tier=tier)
    first = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    assert kv.allocate_slots(first, 5) is not None
    first.num_computed_tokens = 5
    kv.cache_blocks(first, 5)
    kv.free(first)
    other = Request("b", [9, 8, 7, 6, 5, 4, 3], SamplingParams(max_tokens=1))
    assert kv.allocate_slots(other, 7) is not None  # takes all 4 blocks: the 2 cached ones move to the tier
    events = pool.events.take()
    kinds = [(type(e).__name__, e.medium) for e in events]
    # Each key leaves the pool, then enters the tier, block by block: the order replay needs.
    assert kinds == [("BlockStored", "GPU")] + [("BlockRemoved", "GPU"), ("BlockStored", "CPU")] * 2, kinds
    assert sorted(events[0].block_hashes) == sorted(events[1].block_hashes + events[3].block_hashes)
    assert events[2].block_hashes == events[1].block_hashes and events[4].block_hashes == events[3].block_hashes
    offloads, loads = kv.take_tier_copies()
    assert len(offloads) == 2 and loads == []
    # The first prompt again, after the second is gone: served by the tier, loaded into fresh blocks.
    kv.free(other)
    again = Request("c", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    hits, n = kv.get_computed_blocks(again)
    assert (hits, n) == ([], 0)
    entries = kv.get_tier_hits(again, 0)
    assert len(entries) == 2
    assert kv.allocate_slots(again, 1, 4, [], entries) is not None
    offloads, loads = kv.take_tier_copies()
    assert [h for h, _ in loads] == [e.host_block.block_id for e in entries]
    assert [type(e).__name__ for e in pool.events.take()][-1] == "BlockRemoved" and tier.num_blocks == 0


# -- configuration and start-up ------------------------------------------------------------------
def test_a_tier_larger_than_free_host_memory_is_refused_at_start_up_with_the_numbers():
    from pagedserve.engine import Engine

    with pytest.raises(ValueError, match=r"kv_offloading_size: the host KV tier needs 100000\.00 GiB .* "
                                         r"GiB of host memory is available"):
        Engine(small_engine(kv_offloading_size=100000), executor=InstantExecutor(4096))
    with pytest.raises(ValueError, match="kv_offloading_size: .* holds no KV block"):
        Engine(small_engine(kv_offloading_size=1e-9), executor=InstantExecutor(4096))


@pytest.mark.parametrize("knobs, field", [
    (dict(kv_offloading_size=-1), "kv_offloading_size"),
    (dict(kv_offloading_size="lots"), "kv_offloading_size"),
    (dict(kv_offloading_size=1, enable_prefix_caching=False), "kv_offloading_size"),
    (dict(kv_offloading_size=1, kv_offloading_backend="lmcache"), "kv_offloading_backend"),
    (dict(kv_offloading_backend="native"), "kv_offloading_backend"),
])
def test_bad_tier_settings_are_refused_by_name(knobs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        EngineConfig(**knobs)


def test_the_flags_are_vllms():
    config = config_from_flags(["--kv-offloading-backend", "native", "--kv-offloading-size", "0.5"])
    assert config.kv_offloading_size == 0.5 and config.kv_offloading_backend == "native"


# -- the real engine: greedy text equals HF's with the tier on ------------------------------------
def engine_chats(llm, turns: int = 2, seed: int = 0, max_tokens: int = 5):
    """Four chats at once (the pool preempts), two turns; returns (prompts, outputs)."""
    rng = random.Random(seed)
    histories = [[rng.randrange(5, 380) for _ in range(rng.randrange(30, 50))] for _ in range(4)]
    prompts, outputs = [], []
    for _ in range(turns):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        results = llm.generate([list(h) for h in histories], params, use_tqdm=False)
        for h, r in zip(histories, results):
            prompts.append(list(h))
            outputs.append(r.outputs[0].token_ids)
            h.extend(r.outputs[0].token_ids + [rng.randrange(5, 380) for _ in range(20)])
    pool = llm.engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    return prompts, outputs


TINY_BYTES_PER_BLOCK = 16 * 2 * 2 * 2 * 16 * 4  # tokens x layers x K/V x kv heads x head dim x fp32


@pytest.fixture(scope="module")
def hf_reference(tiny_llama):
    return HFGreedyReference(tiny_llama)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_text_equals_hf_with_the_tier_under_forced_preemption(tiny_llama, hf_reference, mode):
    from pagedserve import LLM

    with LLM(str(tiny_llama), num_kv_blocks=12, max_model_len=192, max_num_seqs=4, preemption_mode=mode,
             swap_space="1MiB", kv_offloading_size=tier_gib(48, TINY_BYTES_PER_BLOCK)) as llm:
        assert llm.engine.engine_core.pool.bytes_per_block == TINY_BYTES_PER_BLOCK
        prompts, outputs = engine_chats(llm)
        sched = llm.engine.engine_core.scheduler
        assert sched.total_preemptions_by_mode[mode] > 0
        assert sched.kv.tier.counters.loaded > 0
    hf_reference.assert_greedy(prompts, outputs, [5] * len(outputs), f"{mode}: ")


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_a_quantized_pool_moves_through_the_tier_as_it_is(tiny_llama, kv_dtype):
    """fp8 (values and a per-layer scale) and int8 (values and per-token scales): the same
    tokens with the tier as without it."""
    from pagedserve import LLM

    results = {}
    for size in (None, 0.001):
        # A small swap space: the default 4 GiB of 2 KiB fp8 blocks is two million host blocks to set up.
        with LLM(str(tiny_llama), num_kv_blocks=12, max_model_len=192, max_num_seqs=4, kv_cache_dtype=kv_dtype,
                 preemption_mode="swap", swap_space="1MiB", kv_offloading_size=size) as llm:
            results[size] = engine_chats(llm)
            sched = llm.engine.engine_core.scheduler
            assert sched.total_preemptions_by_mode["swap"] > 0
            if size:
                assert sched.kv.tier.counters.loaded > 0
    assert results[None] == results[0.001]


def test_the_pool_view_shows_the_tier_beside_the_swap_pool():
    """The dashboard's snapshot: the tier's host blocks are the host runs' cached free ones, the
    swapped requests' blocks are the held ones, and the counts say which is which."""
    from pagedserve.core.snapshot import decode_runs, take_snapshot

    _, engine, _ = run_chats(small_engine(preemption_mode="swap", kv_offloading_size=tier_gib(8)), turns=2)
    sched = engine.engine_core.scheduler
    snap = take_snapshot(sched)
    host = decode_runs(snap.host_runs, snap.num_host_blocks)
    assert snap.num_tier_blocks == 8 and 0 < snap.num_tier_used_blocks == sched.kv.tier.num_blocks
    assert sum(1 for b in host if b[0] == -1 and b[3]) == snap.num_tier_used_blocks
    assert snap.num_host_used_blocks == sum(1 for b in host if b[2] > 0) == 0  # nobody swapped at the end
    assert snap.to_dict()["num_tier_used_blocks"] == snap.num_tier_used_blocks


def test_a_block_computed_again_leaves_the_tier():
    """The last prompt token is never served from a cache, so a prompt ending on a block the
    tier holds computes that block again: once the pool publishes it, the tier drops its copy
    (a key in one place at a time), and the events say so."""
    bs = 2
    pool = BlockPool(4, enable_caching=True)
    host = BlockPool(4, reuse_recent_first=True)
    tier = HostTier(host, 4, bs)
    pool.events = tier.events = KVEventLog(bs, "GPU")
    kv = KVCacheManager(pool, bs, host, tier=tier)

    def compute(rid, tokens):
        req = Request(rid, tokens, SamplingParams(max_tokens=1))
        hits, n = kv.get_computed_blocks(req)
        entries = kv.get_tier_hits(req, len(hits))
        assert kv.allocate_slots(req, len(tokens) - n - bs * len(entries), n + bs * len(entries), hits, entries)
        req.num_computed_tokens = len(tokens)
        kv.cache_blocks(req, len(tokens))
        return req, entries

    first, _ = compute("a", [1, 2, 3, 4])
    kv.free(first)
    other, _ = compute("b", [9, 8, 7, 6, 5, 4, 3, 2])  # all 4 blocks: [1,2] and [3,4] move to the tier
    kv.free(other)
    assert tier.num_blocks == 2
    again, loaded = compute("c", [1, 2, 3, 4])  # [1,2] loaded; [3,4] holds the last token: computed
    assert len(loaded) == 1
    cached: set[int] = set()
    replay(cached, pool.events.take())
    from pagedserve.core.kv_cache import block_content, chain_hash

    k12 = chain_hash(None, block_content([1, 2]))
    k34 = chain_hash(k12, block_content([3, 4]))
    assert k12 in pool.hash_to_block and k34 in pool.hash_to_block  # loaded, and computed again
    assert k12 not in tier.entries and k34 not in tier.entries
    assert tier.num_blocks == 2  # what took the pool's blocks for "c": two of "b"'s, evicted to the tier
    assert cached == pool.cached_block_hashes() | tier.block_hashes()
    assert not pool.cached_block_hashes() & tier.block_hashes()


def test_simulate_prices_the_tier_with_the_engines_own_decisions():
    """The simulator drives the same core: on a GPU preset, conversations that outgrow the pool
    hit the tier, fewer prompt tokens are computed, and the report carries the hits and what the
    copies cost against the prefill they saved."""
    from pagedserve.bench.workloads import WorkloadRequest
    from pagedserve.sim.simulator import build_deployment, simulate

    rng = random.Random(0)
    convs = [[rng.randrange(16, 30000) for _ in range(300)] for _ in range(6)]
    work, t = [], 0.0
    for _ in range(3):
        for c in convs:
            work.append(WorkloadRequest(list(c), None, len(c), 8, arrival_time=t))
            t += 0.05
            c.extend(rng.randrange(16, 30000) for _ in range(48))
    results = {}
    for size in (None, 1.0):
        config = EngineConfig(num_kv_blocks=96, kv_offloading_size=size, max_model_len=1024, swap_space="64MiB")
        results[size] = simulate(build_deployment(config, "meta-llama/Llama-3.1-8B", gpu="H100-SXM"), work)
    off, on = results[None], results[1.0]
    assert off.host_tier == {} and on.host_tier["blocks_loaded"] > 0 and 0 < on.host_tier["hit_rate"] <= 1
    assert on.host_tier["load_seconds"] < on.host_tier["recompute_seconds_saved"]
    assert on.server_view()["external_prefix_cache_hits_total"] == on.host_tier["hit_tokens"]
    assert sum(r.ttft for r in on.records) < sum(r.ttft for r in off.records)


def test_plan_says_how_many_prefix_tokens_the_tier_keeps(capsys):
    import json

    from pagedserve.plan.cli import main

    # llama-3.1-8b in bf16: 128 KiB a token, 2 MiB a 16-token block, 1 MiB per rank at TP 2:
    # 8 GiB over both ranks = 4096 blocks per rank (and 4096 of 2 MiB at TP 1)
    assert main(["--model", "llama-3.1-8b", "--gpu", "H100-SXM", "-tp", "2", "--kv-offloading-size", "8",
                 "--json"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv"]
    assert kv["bytes_per_block"] == 1 << 20  # one rank's half of the KV heads
    assert kv["host_tier_blocks"] == 4096 and kv["host_tier_tokens"] == 4096 * 16
    assert main(["--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--kv-offloading-size", "8"]) == 0
    assert "host KV tier           4,096 blocks per rank = 65,536 prefix tokens" in capsys.readouterr().out
    assert main(["--model", "llama-3.1-8b", "--gpu", "H100-SXM"]) == 0
    assert "host KV tier" not in capsys.readouterr().out


@pytest.mark.slow  # two rank processes
def test_tp2_ranks_move_their_own_shards_through_the_tier(tiny_llama, hf_reference):
    """Two TP ranks (one KV head each): the tier's copies ride the step's swap lists, so each
    rank copies its own shard of the same blocks; greedy text equals HF's."""
    from pagedserve import LLM

    with LLM(str(tiny_llama), tensor_parallel_size=2, num_kv_blocks=12, max_model_len=192, max_num_seqs=4,
             preemption_mode="swap", swap_space="1MiB", kv_offloading_size=tier_gib(48, TINY_BYTES_PER_BLOCK)) as llm:
        prompts, outputs = engine_chats(llm)
        sched = llm.engine.engine_core.scheduler
        assert sched.kv.tier.counters.loaded > 0 and sched.total_preemptions_by_mode["swap"] > 0
    hf_reference.assert_greedy(prompts, outputs, [5] * len(outputs), "tp2: ")


def test_an_mla_pool_moves_through_the_tier_as_it_is(tmp_path):
    """DeepSeek-V3 MLA (one compressed latent per token instead of K and V heads): greedy text
    equals HF's with the tier loading the latents back."""
    from checkpoints import make_checkpoint
    from pagedserve import LLM

    path = make_checkpoint(tmp_path / "mla", "deepseek_v3")
    with LLM(str(path), num_kv_blocks=12, max_model_len=192, max_num_seqs=4, preemption_mode="recompute",
             kv_offloading_size=0.01) as llm:
        prompts, outputs = engine_chats(llm)
        assert llm.engine.engine_core.scheduler.kv.tier.counters.loaded > 0
    HFGreedyReference(path).assert_greedy(prompts, outputs, [5] * len(outputs), "mla: ")


def test_metrics_carry_the_tiers_counts_under_vllms_names():
    from pagedserve.core.outputs import SchedulerStats
    from pagedserve.metrics import EngineMetrics

    m = EngineMetrics("m", 128)
    m.set_cache_config("float32", 16, 12, 512, "cpu")  # 8 KiB a block
    for _ in range(2):
        m.record_step(SchedulerStats(tier_queries=100, tier_hits=32, num_blocks_offloaded=3, num_blocks_loaded=2,
                                     tier_used_blocks=5, tier_total_blocks=20, prefix_cache_evicted_hits=16),
                      0.01, 0.01, 10)
    value = lambda name, **labels: m.registry.get_sample_value("pagedserve:" + name, {"model_name": "m", **labels})
    assert value("external_prefix_cache_queries_total") == 200 and value("external_prefix_cache_hits_total") == 64
    assert value("kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") == 6 * 8192
    assert value("kv_offload_total_bytes_total", transfer_type="CPU_to_GPU") == 4 * 8192
    assert value("kv_offload_blocks_total", transfer_type="CPU_to_GPU") == 4
    assert value("kv_offload_cpu_cache_usage_perc") == 0.25
    assert value("prefix_cache_evicted_hits_total") == 32
