"""KV events: what the prefix cache gained and lost, in the order it happened, torch-free.

The host tier (core/kv_tier.py) reports to the same log, with its own medium ("CPU", vLLM's
name for host memory), so one ordered stream covers both: a key lives in at most one of them
(an evicted block moves to the tier, a loaded one back), and replaying the stream rebuilds
the union of what the pool and the tier hold.

The device pool (core/block_pool.py) reports to a KVEventLog when a block becomes cacheable
(it got its prefix key: BlockStored), when a cached block's key is dropped because the block
is handed out for new content (BlockRemoved), and when the whole prefix cache is reset
(AllBlocksCleared). The engine-core loop takes each step's events (`take`) and a publisher
(engine/kv_events.py) ships them to subscribers in vLLM's wire format, so a KV-aware router
can rebuild exactly the set of keys this engine's pool can serve.

Keys on the wire are what vLLM calls an ExternalBlockHash with its default int form: the
pool's 32-byte SHA-256 chained key (core/kv_cache.py) read as a big-endian integer and cut
to its low 64 bits, i.e. `int.from_bytes(key[-8:], "big")`. The engine's own lookups never
rest on these: the pool checks recorded content and parent (block_pool), so the cut costs
nothing in the engine's collision safety.

Invariant: applying the events in order to an empty set (add stored keys, drop removed
ones, empty it on a clear) gives exactly the external keys of the pool's cached blocks
(`BlockPool.cached_block_hashes`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

_LOW_64 = (1 << 64) - 1


def external_block_hash(key: bytes) -> int:
    """The key a subscriber sees: vLLM's int ExternalBlockHash (the low 64 bits, big-endian)."""
    return int.from_bytes(key, "big") & _LOW_64


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]            # the blocks' tokens, block_size per hash, in order
    block_size: int
    medium: str
    # Per block: what besides its tokens its key covers (core/kv_cache.py extra keys; only a
    # request's first block has any), or None. All None -> left out of the message.
    extra_keys: list[bytes | None] = field(default_factory=list)


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str


@dataclass
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Events of the current step, merged as vLLM merges them: a stored block whose parent is
    the previous stored block joins that event (one BlockStored per run of a prefix), and
    consecutive removals share one BlockRemoved. The order of what happened is kept."""

    def __init__(self, block_size: int, medium: str) -> None:
        self.block_size = block_size
        self.medium = medium
        self._events: list[KVEvent] = []

    def stored(self, key: bytes, parent_key: bytes | None, token_ids: list[int], extra_keys: bytes,
               medium: str | None = None) -> None:
        """`medium`: where the block is, when not the pool's own (the host tier's "CPU")."""
        medium = medium or self.medium
        block_hash = external_block_hash(key)
        parent = None if parent_key is None else external_block_hash(parent_key)
        extra = extra_keys or None
        last = self._events[-1] if self._events else None
        if (isinstance(last, BlockStored) and last.medium == medium and parent is not None
                and last.block_hashes[-1] == parent):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            last.extra_keys.append(extra)
            return
        self._events.append(BlockStored([block_hash], parent, list(token_ids), self.block_size, medium, [extra]))

    def removed(self, key: bytes, medium: str | None = None) -> None:
        medium = medium or self.medium
        block_hash = external_block_hash(key)
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash], medium))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)


def device_medium(device: str) -> str:
    """The `medium` of the device pool's events: vLLM's "GPU" for a CUDA pool; "CPU" when the
    pool itself lives in host memory (a CPU engine), since that is where the KV is."""
    return "GPU" if device == "cuda" else "CPU"
