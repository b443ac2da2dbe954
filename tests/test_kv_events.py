"""KV events (--kv-events-config): a subscriber rebuilds exactly the set of blocks the engine's
prefix cache can serve, live and through the replay socket, and every message has the layout
vLLM documents (vllm/distributed/kv_events.py, v0.28: EventBatch array_like [ts, events,
data_parallel_rank]; events tagged maps; frames topic / 8-byte big-endian seq / payload).

The structs below are this test's own transcription of vLLM's schema (field order and struct
options), not the engine's: decoding the engine's bytes with them checks the engine against
the documented layout rather than against itself. Loopback only.
"""
from __future__ import annotations

import hashlib
import random
import socket
import struct
import time
from typing import Any

import httpx
import msgspec
import pytest

from metrics_scrape import scrape, wait_idle
from pagedserve.config import EngineConfig
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache import KVCacheManager
from pagedserve.config import KVEventsConfig
from pagedserve.core.kv_events import BlockRemoved, BlockStored, KVEventLog
from pagedserve.core.request import Request
from pagedserve.sampling import SamplingParams
from pagedserve.server.launcher import ServerThread, build_server

zmq = pytest.importorskip("zmq")


# -- vLLM's schema, transcribed -------------------------------------------------------------
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(VKVEventBatch)


def replay(cached: set[int], events, stored: type = VBlockStored, removed: type = VBlockRemoved) -> None:
    """What an external indexer does with events: stored blocks join the set, removed ones
    leave it, anything else (all blocks cleared) empties it. The classes are vLLM's messages
    as decoded here, or the engine's own events (core.kv_events)."""
    for e in events:
        if isinstance(e, stored):
            cached.update(e.block_hashes)
        elif isinstance(e, removed):
            cached.difference_update(e.block_hashes)
        else:
            cached.clear()


def apply(cached: set[int], batch: VKVEventBatch) -> None:
    """What an external indexer does with one batch."""
    replay(cached, batch.events)


# -- the core: the log against the pool, block by block ---------------------------------------
def indexer_keys(token_ids: list[int], block_size: int, extra: bytes = b"") -> list[int]:
    """The README's recipe: SHA-256 chained from 32 zero bytes over the parent key, the block's
    tokens as little-endian int64 and, for the first block, the extra keys; the low 64 bits."""
    keys, parent = [], bytes(32)
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{len(block)}q", *block) + (extra if i == 0 else b"")).digest()
        keys.append(int.from_bytes(parent[-8:], "big"))
    return keys


@pytest.mark.parametrize("seed", range(4))
def test_events_rebuild_the_pools_cached_set_after_every_operation(seed):
    """Shared prefixes, a pool small enough that every few requests evict, and resets: after
    each operation the events so far give exactly the pool's cached keys."""
    bs, rng = 2, random.Random(seed)
    pool = BlockPool(12, enable_caching=True)
    pool.events = KVEventLog(bs, "CPU")
    kv = KVCacheManager(pool, bs)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(2, 9))] for _ in range(4)]
    cached: set[int] = set()
    seen = {"stored": 0, "removed": 0, "cleared": 0}
    live: list[Request] = []
    for step in range(120):
        action = rng.random()
        if action < 0.55 or not live:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            req = Request(f"r{step}", tokens, SamplingParams(max_tokens=1))
            hits, num_hit = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, len(tokens) - num_hit, num_hit, hits) is not None:
                req.num_computed_tokens = len(tokens)
                kv.cache_blocks(req, len(tokens))
                live.append(req)
        elif action < 0.95:
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            for req in live:
                kv.free(req)
            live.clear()
            assert pool.reset_prefix_cache()
        events = pool.events.take()
        for e in events:
            seen["stored" if isinstance(e, BlockStored) else "removed" if isinstance(e, BlockRemoved) else "cleared"] += 1
        replay(cached, events, BlockStored, BlockRemoved)
        assert cached == pool.cached_block_hashes(), f"step {step}"
    assert min(seen.values()) > 0, seen  # the run stored, evicted and cleared


def test_reset_is_refused_while_a_block_is_in_use():
    pool = BlockPool(4, enable_caching=True)
    pool.events = KVEventLog(2, "CPU")
    kv = KVCacheManager(pool, 2)
    req = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    kv.allocate_slots(req, 5)
    req.num_computed_tokens = 5
    kv.cache_blocks(req, 5)
    before = pool.cached_block_hashes()
    pool.events.take()
    assert not pool.reset_prefix_cache()
    assert pool.cached_block_hashes() == before and len(before) == 2 and pool.events.take() == []
    kv.free(req)
    assert pool.reset_prefix_cache() and pool.cached_block_hashes() == set()


def test_stored_events_carry_what_an_indexer_needs_to_compute_the_keys_from_token_ids():
    """One BlockStored per run of a prefix, parent linking runs, tokens block_size per key, the
    first block's extra keys alongside: the recipe on the token ids gives the engine's keys."""
    bs = 2
    pool = BlockPool(16, enable_caching=True)
    pool.events = KVEventLog(bs, "CPU")
    extra = {"a": b"", "b": b"rope:9"}
    kv = KVCacheManager(pool, bs, extra_keys_for=lambda req: extra[req.request_id[0]])
    a = [7, 2 ** 40, 9, 10, 11, 12, 13]
    for rid, tokens, computed in (("a1", a, 4), ("a1", a, 7), ("b1", a, 7)):
        req = Request(rid, tokens, SamplingParams(max_tokens=1))
        if rid not in kv.block_tables:
            kv.allocate_slots(req, len(tokens))
        req.num_computed_tokens = computed
        kv.cache_blocks(req, computed)
    events = pool.events.take()
    # a1's first chunk (2 blocks), then its third block joined to the same event; b1 separately
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    first, second = events
    assert first.block_hashes == indexer_keys(a, bs) and first.parent_block_hash is None
    assert first.token_ids == a[:6] and first.block_size == bs and first.extra_keys == [None] * 3
    assert second.block_hashes == indexer_keys(a, bs, b"rope:9") and second.extra_keys == [b"rope:9", None, None]
    assert set(first.block_hashes) | set(second.block_hashes) == pool.cached_block_hashes()


def test_kv_events_config_takes_vllms_fields_and_refuses_anything_else():
    c = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.max_queue_size) == (
        "zmq", "tcp://127.0.0.1:5557", None, 10_000, 100_000, 100_000)
    assert KVEventsConfig.parse({}).publisher == "null"
    for bad, field in (('{"enable_kv_cache_events": true, "endpont": "x"}', "endpont"),
                       ('{"publisher": "kafka"}', "publisher"), ('{"buffer_steps": 0}', "buffer_steps"),
                       ("[1]", "JSON object"), ("{", "JSON")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(kv_events_config=bad)


# -- a served engine, end to end -------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A pool of 12 blocks of 16 tokens: the conversations below share prefixes and outgrow it.
ENGINE = dict(max_model_len=128, max_num_seqs=4, num_kv_blocks=12, block_size=16)
STEM = ("You are a helpful assistant that answers questions about paged attention, the KV cache "
        "and how blocks of tokens are handed out and taken back. ")
PROMPTS = [STEM + q for q in ("What is a block?", "Why are blocks fixed size?", "What is eviction?",
                              "What happens when the pool runs dry?")]
PROMPTS += ["An unrelated prompt about the weather in the mountains and the rivers in spring. " * 2,
            STEM + "What is a block?"]


def events_server(tiny_llama, mode: str):
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = EngineConfig(model=str(tiny_llama), kv_events_config={
        "enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay, "topic": "kv"}, **ENGINE)
    app, async_engine = build_server(config, engine_core_mode=mode)
    return app, async_engine, endpoint, replay


class Subscriber:
    def __init__(self, endpoint: str, topic: bytes = b"kv") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        self.sub.connect(endpoint)
        self.frames: list[list[bytes]] = []
        try:  # connected (a wait, not a timing assert: the deadline turns a hang into a failure)
            assert monitor.poll(30_000), f"the subscriber did not connect to {endpoint}"
        finally:
            self.sub.disable_monitor()
            monitor.close()
        time.sleep(0.3)  # the subscription reaches the publisher just after; check_layout checks seq 0 came

    def drain(self, settle_s: float = 1.0) -> list[list[bytes]]:
        """Everything published so far: read until the socket stays quiet for settle_s."""
        while self.sub.poll(int(settle_s * 1000)):
            self.frames.append(self.sub.recv_multipart())
        return self.frames

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()


def request_replay(endpoint: str, start_seq: int) -> list[tuple[int, bytes]]:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert dealer.poll(20_000), "no answer from the replay socket"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b"" and len(seq) == 8
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()
        ctx.term()


def run_conversations(server) -> None:
    for prompt in PROMPTS:  # one at a time: each mode and run makes the same decisions
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text


def conversation_frames(server, endpoint: str) -> list[list[bytes]]:
    """Subscribe, run the conversations, and return every frame published up to the idle engine."""
    sub = Subscriber(endpoint)
    try:
        run_conversations(server)
        wait_idle(server)
        return sub.drain()
    finally:
        sub.close()


def check_layout(frames: list[list[bytes]]) -> None:
    """Every message as vLLM documents it, on the raw bytes."""
    for i, frame in enumerate(frames):
        assert len(frame) == 3
        topic, seq, payload = frame
        assert topic == b"kv" and len(seq) == 8 and int.from_bytes(seq, "big") == i
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and len(raw) == 3, raw  # [ts, events, data_parallel_rank]
        ts, events, rank = raw
        assert isinstance(ts, float) and abs(ts - time.time()) < 3600 and rank == 0 and events
        for e in events:
            assert isinstance(e, dict)
            if e["type"] == "BlockStored":
                assert set(e) - {"extra_keys"} == {"type", "block_hashes", "parent_block_hash", "token_ids",
                                                   "block_size", "lora_id", "medium", "lora_name"}
                assert list(e)[:8] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                       "lora_id", "medium", "lora_name"]
                assert e["block_size"] == 16 and len(e["token_ids"]) == 16 * len(e["block_hashes"])
                assert e["medium"] == "CPU" and e["lora_id"] is None
                hashes = e["block_hashes"] + ([e["parent_block_hash"]] if e["parent_block_hash"] is not None else [])
            else:
                assert e["type"] in ("BlockRemoved", "AllBlocksCleared"), e
                if e["type"] == "BlockRemoved":
                    assert set(e) == {"type", "block_hashes", "medium"} and e["medium"] == "CPU"
                hashes = e.get("block_hashes", [])
            assert all(isinstance(h, int) and 0 <= h < 2 ** 64 for h in hashes)


def test_a_subscriber_rebuilds_the_engines_block_set_live_and_by_replay(tiny_llama):
    app, async_engine, endpoint, replay = events_server(tiny_llama, "thread")
    with ServerThread(app) as server:
        frames = conversation_frames(server, endpoint)
        engine_set = async_engine.engine_core.cached_block_hashes()  # idle: the engine thread only waits
        check_layout(frames)
        batches = [DECODER.decode(f[2]) for f in frames]
        live: set[int] = set()
        for batch in batches:
            apply(live, batch)
        kinds = {type(e).__name__ for b in batches for e in b.events}
        assert {"VBlockStored", "VBlockRemoved"} <= kinds, kinds  # the small pool evicted
        assert live == engine_set and len(engine_set) > 0
        num_events = sum(len(b.events) for b in batches)
        deadline = time.monotonic() + 30  # the counter follows the publisher thread (idle refreshes)
        while (metrics := scrape(server))["pagedserve:kv_events_total{outcome=published}"] != num_events:
            assert time.monotonic() < deadline, (metrics["pagedserve:kv_events_total{outcome=published}"], num_events)
            time.sleep(0.1)
        assert metrics["pagedserve:kv_events_total{outcome=dropped}"] == 0

        # The replay socket: everything from 0, then a subscriber that saw only the first
        # half and asks for the rest.
        replayed = request_replay(replay, 0)
        assert [seq for seq, _ in replayed] == list(range(len(frames)))
        assert [payload for _, payload in replayed] == [f[2] for f in frames]
        rebuilt: set[int] = set()
        for _, payload in replayed:
            apply(rebuilt, DECODER.decode(payload))
        assert rebuilt == engine_set
        half = len(frames) // 2
        resumed: set[int] = set()
        for batch in batches[:half]:
            apply(resumed, batch)
        rest = request_replay(replay, half)
        assert [seq for seq, _ in rest] == list(range(half, len(frames)))
        for _, payload in rest:
            apply(resumed, DECODER.decode(payload))
        assert resumed == engine_set


def test_the_engine_core_process_publishes_the_same_events(tiny_llama):
    """Process mode: the same one-at-a-time conversations give the same event stream (keys,
    tokens, order) as the in-thread engine, whose block set is read directly."""
    batches, streams, engine_sets = {}, {}, {}
    for mode in ("thread", "process"):
        app, async_engine, endpoint, _ = events_server(tiny_llama, mode)
        with ServerThread(app) as server:
            frames = conversation_frames(server, endpoint)
            if async_engine.engine_core is not None:
                engine_sets[mode] = async_engine.engine_core.cached_block_hashes()
        check_layout(frames)
        batches[mode] = [DECODER.decode(f[2]) for f in frames]
        streams[mode] = [[msgspec.to_builtins(e) for e in batch.events] for batch in batches[mode]]
    assert streams["process"] == streams["thread"]
    rebuilt: set[int] = set()
    for batch in batches["process"]:
        apply(rebuilt, batch)
    assert rebuilt == engine_sets["thread"] and rebuilt


def test_offline_llm_publishes_and_a_reset_clears(tiny_llama):
    from pagedserve import LLM

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with LLM(str(tiny_llama), kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint,
                                                 "topic": "kv"}, **ENGINE) as llm:
        sub = Subscriber(endpoint)
        try:
            llm.generate(PROMPTS[:3], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
            assert llm.reset_prefix_cache()
            frames = sub.drain()
        finally:
            sub.close()
        assert llm.engine.engine_core.cached_block_hashes() == set()
    check_layout(frames)
    batches = [DECODER.decode(f[2]) for f in frames]
    assert isinstance(batches[-1].events[-1], VAllBlocksCleared)
    rebuilt: set[int] = {1}
    for batch in batches:
        apply(rebuilt, batch)
    assert rebuilt == set() and any(isinstance(e, VBlockStored) for b in batches for e in b.events)


def test_an_endpoint_in_use_is_refused_at_start_up(tiny_llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match="kv_events_config"):
            build_server(EngineConfig(model=str(tiny_llama), kv_events_config={
                "enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"}, **ENGINE))


def test_metrics_without_kv_events_show_zero(tiny_llama):
    app, _ = build_server(EngineConfig(model=str(tiny_llama), **ENGINE))
    with ServerThread(app) as server:
        run_conversations(server)
        m = wait_idle(server)
    assert m["pagedserve:kv_events_total{outcome=published}"] == 0


def test_a_full_publisher_queue_drops_without_blocking_and_counts_every_lost_event():
    """The engine thread never waits for the publisher: a batch that finds the queue full is
    dropped and its events counted, and /metrics shows the counts as they grow."""
    from pagedserve.engine.kv_events import ZmqEventPublisher
    from pagedserve.metrics import EngineMetrics

    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, max_queue_size=1,
                                                 endpoint=f"tcp://127.0.0.1:{free_port()}"))
    publisher.shutdown()  # its thread is gone: nothing drains the queue any more
    publisher.publish(1.0, [BlockRemoved([1], "CPU")])                    # fills the one slot
    publisher.publish(2.0, [BlockRemoved([2], "CPU"), BlockRemoved([3], "CPU")])  # dropped: 2 events
    publisher.publish(3.0, [BlockRemoved([4], "CPU")])                    # dropped: 1
    assert (publisher.num_published, publisher.num_dropped) == (0, 3)

    m = EngineMetrics("m", 64, log_interval=0)
    m.set_kv_events(5, 0)
    m.set_kv_events(7, 3)
    m.set_kv_events(7, 3)  # cumulative counts: the same totals again add nothing
    value = {outcome: m.registry.get_sample_value("pagedserve:kv_events_total", {"model_name": "m", "outcome": outcome})
             for outcome in ("published", "dropped")}
    assert value == {"published": 7, "dropped": 3}


def test_extra_keys_travel_as_vllm_lays_them_out_one_entry_per_block():
    """A dynamic-RoPE model's first block key covers the prompt length too: the bytes go out in
    `extra_keys` (one entry per block, None where the key is the tokens alone); without any,
    the field is left out, as msgspec's omit_defaults leaves vLLM's."""
    from pagedserve.engine.kv_events import KVEventBatch, to_wire

    with_extra = BlockStored([11, 12], None, [1, 2, 3, 4], 2, "GPU", [b"rope:9", None])
    plain = BlockStored([13], 12, [5, 6], 2, "GPU", [None])
    payload = msgspec.msgpack.encode(KVEventBatch(1.5, to_wire([with_extra, plain]), 0))
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 1.5 and raw[2] == 0
    assert raw[1][0]["extra_keys"] == [[b"rope:9"], None] and "extra_keys" not in raw[1][1]
    assert raw[1][0]["medium"] == "GPU" and raw[1][1]["parent_block_hash"] == 12
    decoded = DECODER.decode(payload)
    assert decoded.events[0].extra_keys == [(b"rope:9",), None] and decoded.events[1].extra_keys is None


def test_with_the_host_tier_a_subscriber_still_rebuilds_the_engines_block_set(tiny_llama):
    """--kv-offloading-size on: blocks the 12-block pool evicts move to the host tier, and back
    on a hit. Decoded with vLLM's schema, the stream (live, and replayed from 0) rebuilds the
    union of what the pool and the tier hold; the tier's blocks have medium CPU."""
    from pagedserve import LLM

    endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with LLM(str(tiny_llama), kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint,
                                                 "replay_endpoint": replay_endpoint, "topic": "kv"},
             kv_offloading_size=64 * 16 * 512 / 2**30, swap_space="1MiB", **ENGINE) as llm:
        sub = Subscriber(endpoint)
        try:
            # One at a time: the shared-stem ones, then unrelated ones that push the weather
            # prompt's blocks out of the 12-block pool, then the weather prompt again (tier hits).
            others = [f"Unrelated text number {i} about {topic}, repeated to fill a few blocks. " * 2
                      for i, topic in enumerate(("ships", "bread", "stars"))]
            for prompt in PROMPTS + others + [PROMPTS[4]]:
                llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
            frames = sub.drain()
        finally:
            sub.close()
        core = llm.engine.engine_core
        engine_set = core.cached_block_hashes()
        tier = core.scheduler.kv.tier
        assert tier.counters.stored > 0 and tier.counters.loaded > 0 and tier.num_blocks > 0
        replayed = request_replay(replay_endpoint, 0)
    check_layout(frames)
    live: set[int] = set()
    for f in frames:
        apply(live, DECODER.decode(f[2]))
    assert live == engine_set and tier.block_hashes() <= live
    rebuilt: set[int] = set()
    for _, payload in replayed:
        apply(rebuilt, DECODER.decode(payload))
    assert rebuilt == engine_set
