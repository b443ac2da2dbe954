"""The host KV tier (--kv-offloading-size): prefix blocks the device pool evicts, kept in host
memory, LRU, under the same chained prefix keys, so that a later prompt with that prefix loads
them back instead of computing them again. Torch-free: it hands out host block ids and copy
pairs; the executor moves the bytes with its swap copy.

One host pool, two users. The tier's blocks come from the same host BlockPool as swap space
(sized swap_space + kv_offloading_size), so swap and the tier share one allocation and one
copy path. The tier keeps at most `capacity` blocks; swap may take any free host block and,
when none is left, makes the tier evict (a cache yields to a preempted request's KV).

Invariants this module keeps:
- a key is in at most one of the device pool's prefix cache and the tier: an evicted block
  moves here (`offer`), a loaded one leaves (`take`), one the pool publishes anew is dropped
  here (`discard`). So the KV events of both, replayed in order, rebuild their union;
- every entry holds one reference on its host block; a block read by a copy this step
  (a load's source, a swap-in's source) is released only at the next step (`begin_step`),
  so nothing written this step (an offload, a swap-out) can land on it before it is read:
  the executor copies device -> host first, then host -> device;
- an entry's KV was copied out of a cached device block whose key, content and parent key it
  records; a lookup serves it only if all three match the prompt's (the chain's parent link
  rests on the 32-byte SHA-256 key here, since the device block it came from is gone);
- a full tier evicts its least recently used entry; no host block left means the block is
  not kept (counted), never a failed request.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable
from collections import OrderedDict
from dataclasses import dataclass

from pagedserve.core.block_pool import BlockPool, KVBlock
from pagedserve.core.kv_events import KVEventLog, external_block_hash

TIER_MEDIUM = "CPU"  # vLLM's medium string for host memory



def longest_chain(entries, keys: list[bytes], contents: list[bytes], parent_key: bytes | None) -> list:
    """The longest run of `entries` (a tier's index by prefix key) for these chain positions,
    the first after `parent_key`: each entry must hold that key, that content and, as its
    parent, the key before it (the device pool checks the parent by identity; a tier below it
    cannot, its parent block having left, and relies on the SHA-256 key chain)."""
    found = []
    for key, content in zip(keys, contents):
        entry = entries.get(key)
        if entry is None or entry.content != content or entry.parent_key != parent_key:
            break
        found.append(entry)
        parent_key = key
    return found

@dataclass(eq=False)
class TierEntry:
    host_block: KVBlock
    key: bytes
    parent_key: bytes | None
    content: bytes


@dataclass
class TierCounters:
    """Cumulative, in blocks (the scheduler adds tokens for the prefix-cache metrics)."""

    stored: int = 0        # blocks copied device -> host
    loaded: int = 0        # blocks copied host -> device
    evicted: int = 0       # entries dropped to make room (LRU, or for swap)
    not_kept: int = 0      # evicted device blocks the tier had no host block for
    lookups: int = 0       # blocks looked up past the device pool's hits
    hits: int = 0          # of which found


class HostTier:
    def __init__(self, host_pool: BlockPool, capacity: int, block_size: int) -> None:
        if capacity < 1:
            raise ValueError(f"kv_offloading_size: the tier must hold at least one block, got {capacity}")
        self.host_pool = host_pool
        self.capacity = capacity
        self.block_size = block_size
        self.entries: OrderedDict[bytes, TierEntry] = OrderedDict()  # oldest first
        self.events: KVEventLog | None = None  # the device pool's log (shared: one ordered stream)
        self.counters = TierCounters()
        self._offloads: list[tuple[int, int]] = []  # (device, host) copies this step
        self._release: list[KVBlock] = []           # host blocks read this step: free next step
        self.on_evict: Callable[[bytes], None] | None = None  # a key the tier drops for room (LRU, swap)
        self.disk = None  # core/kv_disk.DiskTier: where the entries evicted for room go; None = lost

    # -- state --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.entries)

    @property
    def usage(self) -> float:
        return len(self.entries) / self.capacity

    def block_hashes(self) -> set[int]:
        """The keys the tier can serve, as KV events name them (read-only)."""
        return {external_block_hash(key) for key in self.entries}

    # -- the step -----------------------------------------------------------------------
    def begin_step(self) -> None:
        """The previous step's copies are done: the host blocks they read may be reused."""
        if self._release:
            self.host_pool.free(self._release)
            self._release = []

    def release_after_step(self, blocks: list[KVBlock]) -> None:
        """Keep these host blocks (a copy reads them this step) out of reuse until the next step."""
        self._release.extend(blocks)

    def take_offloads(self) -> list[tuple[int, int]]:
        pairs, self._offloads = self._offloads, []
        return pairs

    # -- in: blocks the device pool evicts ------------------------------------------------
    def offer(self, block: KVBlock) -> None:
        """`block` is about to be handed out for new content: keep a host copy of its KV."""
        key = block.block_hash
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if len(self.entries) >= self.capacity:
            self._evict_oldest()
        if self.host_pool.num_free_blocks == 0 and not self._evict_oldest():
            self.counters.not_kept += 1
            return
        host = self.host_pool.allocate(1)[0]
        if self.disk is not None:
            self.disk.discard(key)  # one place at a time
        self.entries[key] = TierEntry(host, key, block.parent_key, block.content)
        self._offloads.append((block.block_id, host.block_id))
        self.counters.stored += 1
        if self.events is not None:
            tokens = array("q")
            tokens.frombytes(block.content[:8 * self.block_size])
            self.events.stored(key, block.parent_key, tokens.tolist(), block.content[8 * self.block_size:],
                               medium=TIER_MEDIUM)

    # -- out: prefix lookups past the device pool ------------------------------------------
    def lookup(self, keys: list[bytes], contents: list[bytes], parent_key: bytes | None) -> list[TierEntry]:
        """The longest run of entries for these chain positions, the first after `parent_key`."""
        self.counters.lookups += len(keys)
        return longest_chain(self.entries, keys, contents, parent_key)

    def count_hits(self, num_blocks: int) -> None:
        self.counters.hits += num_blocks

    def take(self, entries: list[TierEntry]) -> list[KVBlock]:
        """The entries leave the tier for the device pool: their host blocks, which stay held
        until the next step (the load reads them this step)."""
        blocks = []
        for entry in entries:
            del self.entries[entry.key]
            if self.events is not None:
                self.events.removed(entry.key, medium=TIER_MEDIUM)
            blocks.append(entry.host_block)
        self._release.extend(blocks)
        self.counters.loaded += len(blocks)
        return blocks

    def discard(self, key: bytes) -> None:
        """The device pool now holds `key` (computed again): the tier's copy goes."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self._drop(entry)
        if self.disk is not None:
            self.disk.discard(key)

    def adopt(self, host_block: KVBlock, key: bytes, parent_key: bytes | None, content: bytes) -> None:
        """A block the disk tier read back into `host_block` (the tier takes its reference)."""
        if key in self.entries:
            self.host_pool.free([host_block])
            return
        while len(self.entries) >= self.capacity and self._evict_oldest():
            pass
        self.entries[key] = TierEntry(host_block, key, parent_key, content)
        if self.events is not None:
            tokens = array("q")
            tokens.frombytes(content[:8 * self.block_size])
            self.events.stored(key, parent_key, tokens.tolist(), content[8 * self.block_size:], medium=TIER_MEDIUM)

    # -- room -----------------------------------------------------------------------------
    def make_room(self, num_host_blocks: int) -> bool:
        """Evict until the host pool has `num_host_blocks` free (for a swap-out)."""
        while self.host_pool.num_free_blocks < num_host_blocks:
            if not self._evict_oldest():
                return False
        return True

    def clear(self) -> None:
        """Forget everything (a prefix-cache reset; its AllBlocksCleared covers the tier too)."""
        for entry in self.entries.values():
            self._cancel_offload(entry.host_block)
            self.host_pool.free([entry.host_block])
        self.entries.clear()

    def _evict_oldest(self) -> bool:
        if not self.entries:
            return False
        _, entry = self.entries.popitem(last=False)
        self.counters.evicted += 1
        # To the disk tier, unless its bytes are this step's offload (the executor writes
        # host -> disk before any device -> host copy, so those bytes are not there yet).
        spilled = (self.disk is not None and all(p[1] != entry.host_block.block_id for p in self._offloads))
        self._drop(entry)
        if spilled and self.disk.spill(entry.host_block, entry.key, entry.parent_key, entry.content):
            return True
        if self.on_evict is not None:
            self.on_evict(entry.key)
        return True

    def _drop(self, entry: TierEntry) -> None:
        if self.events is not None:
            self.events.removed(entry.key, medium=TIER_MEDIUM)
        self._cancel_offload(entry.host_block)
        self.host_pool.free([entry.host_block])

    def _cancel_offload(self, host_block: KVBlock) -> None:
        """An entry dropped in the step that wrote it: its copy must not race the block's next
        writer in this step's copies (one destination written twice), so it is not made."""
        if self._offloads:
            self._offloads = [p for p in self._offloads if p[1] != host_block.block_id]
