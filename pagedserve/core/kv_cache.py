"""Per-request block tables on top of the BlockPool.

The manager knows which blocks each request holds; the pool knows the blocks. A request
holds exactly ceil(num_computed_or_scheduled_tokens / block_size) blocks: blocks are taken
only when the tokens that need them are scheduled, and given back the moment it ends.
"""
from __future__ import annotations

from pagedserve.core.block_pool import BlockPool, KVBlock
from pagedserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given its parent's: equal hashes mean equal whole prefixes."""
    return hash((parent_hash, token_ids))


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.block_tables: dict[str, list[KVBlock]] = {}
        self._block_hashes: dict[str, list[int]] = {}  # hashes of a request's full blocks, in order
        self._num_published: dict[str, int] = {}       # leading blocks already offered to the cache
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
    def _hashes_for(self, request: Request, num_full_blocks: int) -> list[int]:
        hashes = self._block_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(chain_hash(parent, tuple(request.all_token_ids[i * bs:(i + 1) * bs])))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of cached full blocks matching the request's tokens. The last
        token is never served from cache: its logits must be computed to sample from."""
        if not self.pool.enable_caching:
            return []
        num_full = (request.num_tokens - 1) // self.block_size
        found: list[KVBlock] = []
        for h in self._hashes_for(request, num_full):
            block = self.pool.lookup(h)
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
        rid = request.request_id
        table = self.block_tables.get(rid)
        if not table:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        done = self._num_published.get(rid, 0)
        if num_full <= done:
            return  # only blocks that became full since the last call are new
        hashes = self._hashes_for(request, num_full)
        for i in range(done, num_full):
            self.pool.cache(table[i], hashes[i])
        self._num_published[rid] = num_full

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
        self._block_hashes.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        if table:
            self.pool.free(list(reversed(table)))

    def take_blocks(self, request: Request) -> list[KVBlock]:
        """Remove the request's table without freeing it (the caller frees, e.g. after a swap copy)."""
        self._block_hashes.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        return self.block_tables.pop(request.request_id, [])
