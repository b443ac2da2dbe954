"""KV events on the wire, as vLLM publishes them (--kv-events-config), and the engine-core
loop's hook that ships each step's events (core/kv_events.py) to subscribers.

Wire format (vLLM's vllm/distributed/kv_events.py, as of v0.28):
- a ZMQ PUB socket sends one multipart message per engine step that changed the prefix
  cache: (topic, sequence number as 8 bytes big-endian, payload);
- the payload is msgpack (msgspec) of a KVEventBatch, encoded as an array
  [ts, events, data_parallel_rank]; each event is a map tagged by its class name under
  "type" ("BlockStored", "BlockRemoved", "AllBlocksCleared"), fields left out when they
  hold their default (omit_defaults);
- replay: a ROUTER socket takes [identity, b"", start_seq (8 bytes big-endian)] and answers
  every kept batch with seq >= start_seq as [identity, b"", seq, payload], then
  [identity, b"", -1 (8 bytes, signed), b""] to mark the end. A DEALER client sees
  (b"", seq, payload) frames; keep asking with DEALER (REQ takes one reply per request).
- data parallelism (-dp N): each engine core publishes on its own sockets, as vLLM's do:
  core r binds the configured TCP ports + r (an ipc/inproc address gets "_dp<r>"), and its
  batches carry data_parallel_rank r (`endpoint_for_rank`).

The publisher thread owns the sockets; the engine thread only hands it a step's events
(never blocking: a full queue drops the batch and counts it, the sequence number then
shows subscribers the gap only if a later batch is published, so the dropped count is
exported as a metric).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

from pagedserve.core import kv_events as core_events
from pagedserve.config import KVEventsConfig

logger = logging.getLogger("pagedserve.engine")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


# -- the message layout (field order and struct options are the contract) ----------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to the prefix cache; tagged by class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(events: list[core_events.KVEvent]) -> list[KVCacheEvent]:
    out: list[KVCacheEvent] = []
    for e in events:
        if isinstance(e, core_events.BlockStored):
            extra = None
            if any(k is not None for k in e.extra_keys):
                extra = [None if k is None else (k,) for k in e.extra_keys]
            out.append(BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size,
                                   lora_id=None, medium=e.medium, lora_name=None, extra_keys=extra))
        elif isinstance(e, core_events.BlockRemoved):
            out.append(BlockRemoved(e.block_hashes, e.medium))
        else:
            out.append(AllBlocksCleared())
    return out


# -- publishers -----------------------------------------------------------------------
class NullEventPublisher:
    num_published = 0
    num_dropped = 0

    def publish(self, ts: float, events: list) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _binds(endpoint: str) -> bool:
    """Bind a wildcard, loopback or local-transport address (the engine is the stable end);
    connect to any other host (a collector elsewhere), as vLLM does."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
    return host in ("*", "::", "", "localhost", "::1") or host.startswith("127.")


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """The address data-parallel core `rank` publishes on: the configured one for core 0, the
    TCP port + rank, or an ipc/inproc path + "_dp<rank>", for the others."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"kv_events_config: {endpoint!r} names no TCP port to offset for data-parallel core {rank}")
    return f"{base}:{int(port) + rank}"


class ZmqEventPublisher:
    """PUB socket + optional ROUTER replay socket, both owned by one publisher thread."""

    SHUTDOWN_TIMEOUT = 2.0

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self._zmq = zmq
        self._rank = data_parallel_rank
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.num_published = 0  # events sent on the PUB socket
        self.num_dropped = 0    # events lost: queue full, or a failed encode/send
        self.endpoint = endpoint_for_rank(config.endpoint, data_parallel_rank)
        self.replay_endpoint = (endpoint_for_rank(config.replay_endpoint, data_parallel_rank)
                                if config.replay_endpoint is not None else None)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            (self._pub.bind if _binds(self.endpoint) else self._pub.connect)(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close()
            raise ValueError(f"kv_events_config: cannot open {self.endpoint}"
                             f"{' / ' + self.replay_endpoint if self.replay_endpoint else ''}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="pagedserve-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s%s%s", self.endpoint,
                    f" (topic {config.topic!r})" if config.topic else "",
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    def publish(self, ts: float, events: list) -> None:
        """From the engine thread; never blocks."""
        try:
            self._queue.put_nowait((ts, events))
        except queue.Full:
            self.num_dropped += len(events)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:  # noqa: BLE001 - a bad replay request costs that request only
                    logger.exception("KV events: replay request failed")
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = encoder.encode(KVEventBatch(ts, to_wire(events), self._rank))
                seq = self._next_seq
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # noqa: BLE001 - the engine goes on; the loss is counted
                logger.exception("KV events: publishing a batch failed")
                self.num_dropped += len(events)
                continue
            self._next_seq += 1
            self._kept.append((seq, payload))
            self.num_published += len(events)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignored a replay request of %d frames (want identity, empty, "
                           "8-byte start sequence)", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._kept):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def shutdown(self) -> None:
        """Send what is queued (bounded wait), then close the sockets."""
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT)
        except queue.Full:
            pass
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop; %d batches unsent", self._queue.qsize())
            return  # its sockets are still in use: leave them to process exit
        self._close()

    def _close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


# -- the engine-core loop's hook --------------------------------------------------------
class KVEventsHook:
    """Observes the engine core after each step (or idle snapshot): takes the events the pool
    logged, hands them to the publisher, and stamps the outputs with the running counts (the
    API process turns them into /metrics counters)."""

    def __init__(self, publisher) -> None:
        self.publisher = publisher

    def after_step(self, core, outputs) -> None:
        events = core.take_kv_events()
        if events:
            self.publisher.publish(time.time(), events)
        outputs.kv_events_published = self.publisher.num_published
        outputs.kv_events_dropped = self.publisher.num_dropped

    def shutdown(self) -> None:
        self.publisher.shutdown()


def make_kv_events_hook(config) -> KVEventsHook | None:
    """The hook an engine-core loop runs (an EngineConfig's; under -dp its core's own sockets),
    or None when KV events are off."""
    events = config.kv_events_config
    if events is None or not events.enable_kv_cache_events or not config.enable_prefix_caching:
        return None
    return KVEventsHook(ZmqEventPublisher(events, config.data_parallel_rank)
                        if events.publishes else NullEventPublisher())
