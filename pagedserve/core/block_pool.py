"""A fixed pool of KV blocks with O(1) allocate/free and prefix-cache bookkeeping.

Invariants this module keeps:
- every block is either in the free queue (ref_cnt == 0) or referenced (ref_cnt >= 1), never both;
- a free block may still carry a hash: it is cached and reusable until it is handed out
  again, at which point its hash is dropped (eviction), oldest-freed first;
- ref_cnt equals the number of block tables that hold the block (the manager keeps that).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    # Intrusive free-list links: no allocation or search to move a block in or out.
    prev_free: "KVBlock | None" = None
    next_free: "KVBlock | None" = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks in LRU order: the head is evicted first."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("no free blocks")
        self.remove(block)
        return block

    def __iter__(self):
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.hash_to_block: dict[int, KVBlock] = {}

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
        """Take n blocks from the head of the free queue (evicting their cached hashes)."""
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
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
    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.hash_to_block.get(block_hash)

    def touch(self, block: KVBlock) -> None:
        """Take a reference on a cached block, reviving it from the free queue if needed."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def cache(self, block: KVBlock, block_hash: int) -> None:
        """Record that `block` holds the full block whose chained hash is `block_hash`."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.hash_to_block:
            return  # an identical block is already cached; keep the first
        block.block_hash = block_hash
        self.hash_to_block[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) is block:
                del self.hash_to_block[block.block_hash]
            block.block_hash = None
