"""A fixed pool of KV blocks with O(1) allocate/free and prefix-cache bookkeeping.

Invariants this module keeps:
- every block is either in the free queue (ref_cnt == 0) or referenced (ref_cnt >= 1), never both;
- a free block may still carry a hash: it is cached and reusable until it is handed out
  again, at which point its hash is dropped (eviction), oldest-freed first;
- ref_cnt equals the number of block tables that hold the block (the manager keeps that);
- a cached block records what its KV was computed from: its own content (tokens and extra
  keys) and its parent, the cached block before it as of the parent's `epoch`. A block's
  epoch grows each time it is handed out for new content. A lookup serves a block only if
  all three match, so what the prefix cache serves never rests on the hash alone: a hash
  collision costs a cache miss, never another prompt's KV;
- when `events` is set (a core.kv_events.KVEventLog), every key that enters or leaves
  `hash_to_block` is reported to it, in order: replaying the events rebuilds
  `cached_block_hashes()` exactly.

The host swap pool is a BlockPool with `reuse_recent_first`: it hands out the most recently
freed block first (a stack), lowest ids first while none was ever freed. Its memory is
mapped lazily, so a page is resident once written and stays so; handing out the oldest
free block instead would walk the whole swap space, one never-touched block per swap,
until all of it is resident. Stack order keeps what is resident at the most blocks ever
swapped out at once.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedserve.core.kv_events import KVEventLog, external_block_hash


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    epoch: int = 0                     # times handed out: a parent identity that outlives reuse
    content: bytes | None = None       # set while cached: what the KV was computed from...
    parent: "KVBlock | None" = None    # ...after this cached block...
    parent_epoch: int = 0              # ...as it was at this epoch
    parent_key: bytes | None = None    # ...whose prefix key this was (the host tier keeps it past eviction)
    # Intrusive free-list links: no allocation or search to move a block in or out.
    prev_free: "KVBlock | None" = None
    next_free: "KVBlock | None" = None

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:12] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={digest})"

    def holds(self, content: bytes, parent: "KVBlock | None", parent_epoch: int) -> bool:
        """True if this cached block's KV was computed from `content` after exactly `parent`."""
        return self.content == content and self.parent is parent and self.parent_epoch == parent_epoch


class FreeBlockQueue:
    """Doubly-linked list of free blocks in LRU order: the head is evicted first."""

    def __init__(self, blocks: list[KVBlock], fresh: "_FreshBlocks | None" = None) -> None:
        """`fresh`: blocks never handed out, not yet made, standing before every linked one
        (the pool makes a block the first time it is taken: a 4 GiB swap space is half a
        million blocks, most never used)."""
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.fresh = fresh
        self.num_linked = 0
        for b in blocks:
            self.append(b)

    @property
    def num_free(self) -> int:
        return self.num_linked + (len(self.fresh) if self.fresh is not None else 0)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_linked += 1

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_linked -= 1

    def pop(self) -> KVBlock:
        """The most recently appended block."""
        block = self._tail.prev_free
        if block is self._head:
            if self.fresh:
                return self.fresh.take_last()
            raise RuntimeError("no free blocks")
        self.remove(block)
        return block

    def popleft(self) -> KVBlock:
        if self.fresh:
            return self.fresh.take_first()
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("no free blocks")
        self.remove(block)
        return block

    def __iter__(self):
        if self.fresh is not None:
            yield from self.fresh
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free


class _FreshBlocks:
    """Ids lo..hi-1 of a pool's blocks, never handed out and not yet made, in the order they
    stand at the free queue's head: ascending, or descending (a stack's bottom, so that its
    pops take the lowest id first). Taking one makes it, in the pool's `made` list."""

    def __init__(self, made: list, num_blocks: int, ascending: bool) -> None:
        self.made, self.lo, self.hi, self.ascending = made, 0, num_blocks, ascending

    def __len__(self) -> int:
        return self.hi - self.lo

    def __iter__(self):
        ids = range(self.lo, self.hi) if self.ascending else range(self.hi - 1, self.lo - 1, -1)
        return (self.make(i) for i in list(ids))

    def make(self, block_id: int) -> KVBlock:
        block = self.made[block_id]
        if block is None:
            block = self.made[block_id] = KVBlock(block_id)
        return block

    def _take(self, block_id: int) -> KVBlock:
        if block_id == self.lo:
            self.lo += 1
        else:
            self.hi -= 1
        return self.make(block_id)

    def take_first(self) -> KVBlock:
        return self._take(self.lo if self.ascending else self.hi - 1)

    def take_last(self) -> KVBlock:
        return self._take(self.hi - 1 if self.ascending else self.lo)


class _PoolBlocks:
    """`pool.blocks`: block i, made when first read (see _FreshBlocks)."""

    def __init__(self, fresh: _FreshBlocks) -> None:
        self._fresh = fresh

    def __len__(self) -> int:
        return len(self._fresh.made)

    def __getitem__(self, block_id: int) -> KVBlock:
        if not 0 <= block_id < len(self._fresh.made):
            raise IndexError(block_id)
        return self._fresh.make(block_id)

    def __iter__(self):
        return (self._fresh.make(i) for i in range(len(self._fresh.made)))

    def made(self):
        """The blocks made so far (every block that was ever handed out among them)."""
        return (b for b in self._fresh.made if b is not None)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False, reuse_recent_first: bool = False) -> None:
        """`reuse_recent_first`: allocate the most recently freed block first (the host swap
        pool: see the module's docstring); otherwise the least recently freed (LRU eviction)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if reuse_recent_first and enable_caching:
            raise ValueError("reuse_recent_first: a prefix-caching pool evicts the oldest block first")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.reuse_recent_first = reuse_recent_first
        # Every block starts free and unmade; a stack pops from the tail, so its unmade blocks
        # stand in descending order and block 0 goes first.
        fresh = _FreshBlocks([None] * num_blocks, num_blocks, ascending=not reuse_recent_first)
        self.blocks = _PoolBlocks(fresh)
        self.free_queue = FreeBlockQueue([], fresh)
        self.hash_to_block: dict[bytes, KVBlock] = {}
        self.events: KVEventLog | None = None  # KV events (--kv-events-config); None = not recorded
        # Called with a cached block just before its key is dropped for new content (the
        # host tier, core/kv_tier.py, copies it out then); None = the key is simply lost.
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks from the head of the free queue (evicting their cached hashes), or
        from its tail with reuse_recent_first."""
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        take = self.free_queue.pop if self.reuse_recent_first else self.free_queue.popleft
        out = []
        for _ in range(n):
            block = take()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the queue's tail in
        the order given (callers pass a table reversed so its tail is evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    # -- prefix cache -------------------------------------------------------------
    def lookup(self, block_hash: bytes, content: bytes, parent: KVBlock | None) -> KVBlock | None:
        """The cached block under `block_hash` if it holds `content` after `parent` (a block
        this lookup chain found just before, so its epoch is current), else None."""
        block = self.hash_to_block.get(block_hash)
        if block is None or not block.holds(content, parent, parent.epoch if parent else 0):
            return None
        return block

    def touch(self, block: KVBlock) -> None:
        """Take a reference on a cached block, reviving it from the free queue if needed."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def cache(self, block: KVBlock, block_hash: bytes, content: bytes, parent: KVBlock | None,
              parent_epoch: int, token_ids: Sequence[int] = ()) -> KVBlock | None:
        """Publish `block` as holding `content` after `parent` (as of `parent_epoch`).

        Returns the cached block that now stands for this prefix: `block`, or an identical
        one cached earlier (the first is kept). None when nothing stands for it: caching is
        off, the parent has been handed out again since, or the key belongs to a different
        prefix (a hash collision); then blocks after this one cannot be published either.
        `token_ids`: the block's tokens (the leading part of `content`), for the KV events.
        """
        if not self.enable_caching:
            return None
        if parent is not None and parent.epoch != parent_epoch:
            return None
        existing = self.hash_to_block.get(block_hash)
        if existing is not None:
            return existing if existing.holds(content, parent, parent_epoch) else None
        if block.block_hash is not None:
            return None  # cached under another key: its content is not this one
        block.block_hash = block_hash
        block.content, block.parent, block.parent_epoch = content, parent, parent_epoch
        block.parent_key = parent.block_hash if parent is not None else None
        self.hash_to_block[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, parent.block_hash if parent is not None else None, list(token_ids),
                               content[8 * len(token_ids):])
        return block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached key (vLLM's reset_prefix_cache): only when no block is in use,
        since a running request's table would then point at blocks its successors could no
        longer find. Returns whether it reset."""
        if self.num_used_blocks:
            return False
        for block in self.blocks.made():
            if block.block_hash is not None:
                block.block_hash = None
                block.content = block.parent = block.parent_key = None
                block.epoch += 1  # chains recorded against the old content must not match again
        self.hash_to_block.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def cached_block_hashes(self) -> set[int]:
        """The keys the prefix cache can serve now, as KV events name them (read-only)."""
        return {external_block_hash(key) for key in self.hash_to_block}

    def _evict(self, block: KVBlock) -> None:
        """`block` is being handed out for new content: drop its cache entry and start a new epoch."""
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) is block:
                del self.hash_to_block[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
                if self.on_evict is not None:  # after the removal: the key moves, in that order
                    self.on_evict(block)
            block.block_hash = None
            block.content = block.parent = block.parent_key = None
        block.epoch += 1
