"""Per-request block tables on top of the BlockPool.

The manager knows which blocks each request holds; the pool knows the blocks. A request
holds exactly ceil(num_computed_or_scheduled_tokens / block_size) blocks: blocks are taken
only when the tokens that need them are scheduled, and given back the moment it ends.

Prefix cache keys: a full block's key is SHA-256 over its parent's key and its content (its
token ids packed as int64, and for a request's first block the request's extra keys: what
else its KV depends on, e.g. a LoRA id, a cache salt, or a dynamic-RoPE prompt length). So a
key names the whole prefix, and two prefixes share one only through a SHA-256 collision.
Lookups do not rest on that alone: the pool serves a block only if its recorded content and
parent match (block_pool), so even a broken hash could cost hits, never correctness. Each
key is computed once per full block of a request and kept until the request leaves.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedserve.core.block_pool import BlockPool, KVBlock
from pagedserve.request import Request

ROOT_HASH = bytes(32)  # the "parent" of a request's first block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_content(token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    """The bytes a block's KV depends on besides its parent. Tokens come first, packed at a
    fixed 8 bytes each, so for one block size no token run can pose as extra keys."""
    return array("q", token_ids).tobytes() + extra_keys


def chain_hash(parent_hash: bytes | None, content: bytes) -> bytes:
    """Key of a full block given its parent's key (None for a first block)."""
    return hashlib.sha256((parent_hash or ROOT_HASH) + content).digest()


@dataclass
class _PrefixChain:
    """A request's full blocks as the prefix cache sees them."""

    hashes: list[bytes] = field(default_factory=list)
    contents: list[bytes] = field(default_factory=list)
    # Per published block: the cached block standing for that prefix and its epoch then,
    # or None where nothing could be published (nothing after it can be either).
    published: list[tuple[KVBlock, int] | None] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int,
                 extra_keys_for: Callable[[Request], bytes] | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.block_tables: dict[str, list[KVBlock]] = {}
        # What a request's KV depends on besides its tokens (b"" when nothing): keys its first block.
        self.extra_keys_for = extra_keys_for or (lambda request: b"")
        self._chains: dict[str, _PrefixChain] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0     # of which found

    # -- counts for metrics ---------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request_id, ())]

    def num_blocks_held(self, request_id: str) -> int:
        return len(self.block_tables.get(request_id, ()))

    # -- prefix cache -----------------------------------------------------------------
    def _chain(self, request: Request, num_full_blocks: int) -> _PrefixChain:
        """The request's chain with keys for at least its first `num_full_blocks` blocks."""
        chain = self._chains.setdefault(request.request_id, _PrefixChain())
        bs = self.block_size
        while len(chain.hashes) < num_full_blocks:
            i = len(chain.hashes)
            content = block_content(request.all_token_ids[i * bs:(i + 1) * bs],
                                    self.extra_keys_for(request) if i == 0 else b"")
            chain.hashes.append(chain_hash(chain.hashes[-1] if i else None, content))
            chain.contents.append(content)
        return chain

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of cached full blocks matching the request's tokens. The last
        token is never served from cache: its logits must be computed to sample from."""
        if not self.pool.enable_caching:
            return []
        num_full = (request.num_tokens - 1) // self.block_size
        chain = self._chain(request, num_full)
        found: list[KVBlock] = []
        for block_hash, content in zip(chain.hashes[:num_full], chain.contents[:num_full]):
            block = self.pool.lookup(block_hash, content, found[-1] if found else None)
            if block is None:
                break
            found.append(block)
        return found

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's newly computed full blocks to the prefix cache."""
        if not self.pool.enable_caching:
            return
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        chain = self._chain(request, num_full)
        for i in range(len(chain.published), num_full):  # only blocks that became full since the last call
            before = chain.published[i - 1] if i else (None, 0)
            if before is None:
                chain.published.append(None)
                continue
            parent, parent_epoch = before
            stands = self.pool.cache(table[i], chain.hashes[i], chain.contents[i], parent, parent_epoch)
            chain.published.append(None if stands is None else (stands, stands.epoch))

    # -- allocation -------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached: list[KVBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after request.num_computed_tokens.

        `cached` (only for a request holding nothing yet) are prefix-cache hits that the
        request adopts; request.num_computed_tokens must already count their tokens.
        Returns False and changes nothing if the pool cannot supply the blocks.
        """
        cached = cached or []
        table = self.block_tables.get(request.request_id)
        if cached and table:
            raise RuntimeError("cached blocks can only be adopted by a request holding none")
        held = len(table) if table else len(cached)
        needed = max(cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - held, 0)
        revived = sum(1 for b in cached if b.ref_cnt == 0)
        if needed + revived > self.pool.num_free_blocks:
            return False
        if table is None:
            table = self.block_tables[request.request_id] = []
        for block in cached:
            self.pool.touch(block)
            table.append(block)
        if needed:
            table.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        """Return all of the request's blocks. Reversed, so that when prefix caching keeps
        them, a prefix's tail is evicted before its head (the head is likelier shared)."""
        table = self.block_tables.pop(request.request_id, None)
        self._chains.pop(request.request_id, None)
        if table:
            self.pool.free(list(reversed(table)))

    def take_blocks(self, request: Request) -> list[KVBlock]:
        """Remove the request's table without freeing it (the caller frees, e.g. after a swap copy)."""
        self._chains.pop(request.request_id, None)
        return self.block_tables.pop(request.request_id, [])
