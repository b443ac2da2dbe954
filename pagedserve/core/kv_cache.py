"""The KV-cache manager: per-request block tables over the device pool, the host pool for
swapped requests, and the prefix cache's lookups and counters.

The scheduler asks it questions and gets block ids back; it never sees a table or a pool.

Invariants this module keeps:
- a running request holds exactly the blocks its computed-or-scheduled tokens need:
  ceil(tokens / block_size), taken only when those tokens are scheduled;
- a call that cannot be satisfied returns None and changes nothing (no partial allocation);
- a swapped request holds host blocks only (one per device block it gave up), a running one
  device blocks only; a finished one nothing;
- a block's ref_cnt equals the number of tables holding it (the pool keeps the free queue);
- with a host tier (core/kv_tier.py): cached blocks the pool evicts move there, and a lookup
  that runs out of device hits goes on in the tier; each step's copies (offloads device ->
  host, loads host -> device) ride the swap lists of that step's SchedulerOutput.

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
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pagedserve.core.block_pool import BlockPool, KVBlock
from pagedserve.core.kv_tier import HostTier, TierEntry
from pagedserve.core.request import Request

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


class TableRows(NamedTuple):
    """One block table as the pool view reads it: per position, the block id, its reference
    count, and whether it is published in the prefix cache."""

    ids: list[int]
    ref_cnts: list[int]
    cached: list[bool]


def _rows(table: list[KVBlock]) -> TableRows:
    return TableRows([b.block_id for b in table], [b.ref_cnt for b in table], [b.block_hash is not None for b in table])


class KVCacheView:
    """A read-only view of a KVCacheManager by block id, for observers (core/snapshot.py):
    they see sizes, counts and each request's table as numbers, never the manager's tables
    or the pool's blocks, so nothing they do can change either."""

    def __init__(self, kv: "KVCacheManager") -> None:
        self._kv = kv

    @property
    def block_size(self) -> int:
        return self._kv.block_size

    @property
    def num_blocks(self) -> int:
        return self._kv.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._kv.pool.num_used_blocks

    @property
    def num_host_blocks(self) -> int:
        """0: no host swap pool."""
        return self._kv.host_pool.num_blocks if self._kv.host_pool is not None else 0

    @property
    def num_host_used_blocks(self) -> int:
        """Swap and the host tier together (they share the host pool)."""
        return self._kv.host_pool.num_used_blocks if self._kv.host_pool is not None else 0

    @property
    def num_tier_blocks(self) -> int:
        """The host tier's capacity in blocks; 0: no tier."""
        return self._kv.tier.capacity if self._kv.tier is not None else 0

    @property
    def num_tier_used_blocks(self) -> int:
        return self._kv.tier.num_blocks if self._kv.tier is not None else 0

    @property
    def num_host_swap_blocks(self) -> int:
        """Host blocks held by swapped-out requests (the rest of the used ones: the tier's)."""
        return sum(len(t) for t in self._kv.host_tables.values())

    def tier_host_block_ids(self) -> list[int]:
        """Host blocks holding the tier's prefixes; [] without a tier."""
        tier = self._kv.tier
        return [e.host_block.block_id for e in tier.entries.values()] if tier is not None else []

    def device_table(self, request_id: str) -> TableRows | None:
        table = self._kv.block_tables.get(request_id)
        return _rows(table) if table else None

    def host_table(self, request_id: str) -> TableRows | None:
        table = self._kv.host_tables.get(request_id)
        return _rows(table) if table else None

    def cached_free_block_ids(self) -> list[int]:
        """Free blocks that keep a prefix (reusable until handed out again); [] without caching."""
        pool = self._kv.pool
        if not pool.enable_caching:
            return []
        return [b.block_id for b in pool.hash_to_block.values() if b.ref_cnt == 0]


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, host_pool: BlockPool | None = None,
                 extra_keys_for: Callable[[Request], bytes] | None = None, tier: HostTier | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.host_pool = host_pool                     # swap space (and the tier's blocks); None = neither
        self.tier = tier                               # the host KV tier; None = evicted prefixes are lost
        if tier is not None:
            if not pool.enable_caching or tier.host_pool is not host_pool:
                raise ValueError("kv_offloading_size: the host tier needs prefix caching and the host pool")
            pool.on_evict = tier.offer
            tier.on_evict = self._remember_evicted
        elif pool.enable_caching:
            pool.on_evict = lambda block: self._remember_evicted(block.block_hash)
        self._loads: list[tuple[int, int]] = []        # (host, device) tier loads this step
        # Keys the cache lost for room (the pool's, or the tier's when there is one), newest
        # last, a bounded few per pool block: a later prompt that misses on one of them shows a
        # reused prefix was evicted, which a (larger) host tier would have served (`advise`).
        self._evicted: OrderedDict[bytes, None] = OrderedDict()
        self._evicted_capacity = 4 * (pool.num_blocks + (tier.capacity if tier is not None else 0))
        self.block_tables: dict[str, list[KVBlock]] = {}
        self.host_tables: dict[str, list[KVBlock]] = {}
        # What a request's KV depends on besides its tokens (b"" when nothing): keys its first block.
        self.extra_keys_for = extra_keys_for or (lambda request: b"")
        self._chains: dict[str, _PrefixChain] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache (cumulative)
        self.prefix_hits = 0     # of which found

    # -- pool state ---------------------------------------------------------------------
    def view(self) -> KVCacheView:
        """Read-only, by block id: what observers (the dashboard's pool view) may see."""
        return KVCacheView(self)

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def caches_blocks(self) -> bool:
        """Whether cache_blocks publishes anything (prefix caching is on)."""
        return self.pool.enable_caching

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request_id, ())]

    def num_blocks_held(self, request_id: str) -> int:
        return len(self.block_tables.get(request_id, ()))

    # -- prefix cache -------------------------------------------------------------------
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

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The ids of the longest run of cached full blocks matching the request's tokens, and
        the number of tokens they hold. The last token is never served from cache: its logits
        must be computed to sample from. Looks only: nothing is taken until allocate_slots."""
        if not self.pool.enable_caching:
            return [], 0
        num_full = (request.num_tokens - 1) // self.block_size
        chain = self._chain(request, num_full)
        found: list[KVBlock] = []
        for block_hash, content in zip(chain.hashes[:num_full], chain.contents[:num_full]):
            block = self.pool.lookup(block_hash, content, found[-1] if found else None)
            if block is None:
                break
            found.append(block)
        return [b.block_id for b in found], len(found) * self.block_size

    def get_tier_hits(self, request: Request, num_device_hit_blocks: int) -> list[TierEntry]:
        """The host tier's run of blocks right after the device pool's hits (the last token is
        never served, as above). Looks only: nothing moves until allocate_slots."""
        if self.tier is None:
            return []
        num_full = (request.num_tokens - 1) // self.block_size
        if num_full <= num_device_hit_blocks:
            return []
        chain = self._chain(request, num_full)
        i = num_device_hit_blocks
        return self.tier.lookup(chain.hashes[i:num_full], chain.contents[i:num_full],
                                chain.hashes[i - 1] if i else None)

    @property
    def disk(self):
        """The disk tier below the host tier (core/kv_disk.py); None = none."""
        return self.tier.disk if self.tier is not None else None

    def get_disk_hits(self, request: Request, num_hit_blocks: int) -> list:
        """The disk tier's run of blocks right after the pool's and the host tier's hits."""
        disk = self.disk
        if disk is None or not disk.enabled:
            return []
        num_full = (request.num_tokens - 1) // self.block_size
        if num_full <= num_hit_blocks:
            return []
        chain = self._chain(request, num_full)
        i = num_hit_blocks
        return disk.lookup(chain.hashes[i:num_full], chain.contents[i:num_full], chain.hashes[i - 1] if i else None)

    def _remember_evicted(self, key: bytes) -> None:
        self._evicted[key] = None
        self._evicted.move_to_end(key)
        if len(self._evicted) > self._evicted_capacity:
            self._evicted.popitem(last=False)

    def count_evicted_hits(self, request: Request, num_hit_blocks: int) -> int:
        """Tokens of the prompt's blocks right after its hits (device and tier) that the cache
        held once and evicted: what it would have served with more room."""
        if not self._evicted:
            return 0
        num_full = (request.num_tokens - 1) // self.block_size
        chain = self._chain(request, num_full)
        n = 0
        for key in chain.hashes[num_hit_blocks:num_full]:
            if key not in self._evicted:
                break
            n += 1
        return n * self.block_size

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks up to num_computed_tokens to the prefix cache."""
        if not self.pool.enable_caching:
            return
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table))
        chain = self._chain(request, num_full)
        for i in range(len(chain.published), num_full):  # only blocks that became full since the last call
            before = chain.published[i - 1] if i else (None, 0)
            if before is None:
                chain.published.append(None)
                continue
            parent, parent_epoch = before
            if self.tier is not None:
                # A key lives in one place at a time; the tier's copy goes first, so its
                # BlockRemoved precedes the pool's BlockStored (a replay keeps the key).
                self.tier.discard(chain.hashes[i])
            stands = self.pool.cache(table[i], chain.hashes[i], chain.contents[i], parent, parent_epoch,
                                     request.all_token_ids[i * self.block_size:(i + 1) * self.block_size])
            chain.published.append(None if stands is None else (stands, stands.epoch))

    # -- allocation ---------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_block_ids: Sequence[int] = (),
                       tier_hits: Sequence[TierEntry] = ()) -> list[int] | None:
        """Room for `num_new_tokens` tokens after the request's computed ones and the
        `num_new_computed_tokens` that the blocks `new_computed_block_ids` (prefix-cache hits
        from get_computed_blocks, for a request holding nothing yet) and `tier_hits` (from
        get_tier_hits: loaded into fresh device blocks, right after the device hits) bring along.

        Returns the ids of the blocks appended to its table (hits first), or None and changes
        nothing when the pool cannot supply them.
        """
        table = self.block_tables.get(request.request_id)
        if table is not None and not new_computed_block_ids and not tier_hits:
            # A running request (a decode, the next chunk): usually its last block has room.
            if cdiv(request.num_computed_tokens + num_new_computed_tokens + num_new_tokens,
                    self.block_size) <= len(table):
                return []
        new_computed_blocks = [self.pool.blocks[i] for i in new_computed_block_ids]
        if new_computed_blocks and table:
            raise RuntimeError("cached blocks can only be adopted by a request holding none")
        held = (len(table) if table else 0) + len(new_computed_blocks)
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        needed = max(cdiv(num_tokens, self.block_size) - held, 0)
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)  # leave the free queue
        if needed + revived > self.pool.num_free_blocks:
            return None
        if table is None:
            table = self.block_tables[request.request_id] = []
        for block in new_computed_blocks:
            self.pool.touch(block)
        # Out of the tier before allocating: the evictions that allocation causes may not push them out.
        sources = self.tier.take(list(tier_hits)) if tier_hits else []
        fresh = self.pool.allocate(needed) if needed else []
        self._loads.extend((h.block_id, d.block_id) for h, d in zip(sources, fresh))
        appended = list(new_computed_blocks) + fresh
        table.extend(appended)
        return [b.block_id for b in appended]

    # -- the step's copies -----------------------------------------------------------------
    def begin_step(self) -> None:
        """A new step: host blocks the previous step's copies read may be reused."""
        if self.tier is not None:
            self.tier.begin_step()
            if self.tier.disk is not None:
                self.tier.disk.begin_step()

    def take_tier_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's tier copies: (device, host) offloads and (host, device) loads."""
        if self.tier is None:
            return [], []
        loads, self._loads = self._loads, []
        return self.tier.take_offloads(), loads

    def free(self, request: Request) -> None:
        """Return all of the request's blocks, device and host. Reversed, so that when prefix
        caching keeps them, a prefix's tail is evicted before its head (likelier shared)."""
        rid = request.request_id
        table = self.block_tables.pop(rid, None)
        self._forget_hashes(rid)
        if table:
            self.pool.free(list(reversed(table)))
        host = self.host_tables.pop(rid, None)
        if host:
            self.host_pool.free(host)

    def _forget_hashes(self, request_id: str) -> None:
        self._chains.pop(request_id, None)

    # -- swap ---------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        """Whether the host pool has room for all of the request's device blocks (the tier's
        entries yield to a swap)."""
        if self.host_pool is None:
            return False
        room = self.host_pool.num_free_blocks + (self.tier.num_blocks if self.tier is not None else 0)
        return room >= self.num_blocks_held(request.request_id)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the host pool; returns (device, host) copy pairs. The
        device blocks are free at once: the executor copies them out before any reuse."""
        if not self.can_swap_out(request):
            raise RuntimeError(f"no host room to swap out {request.request_id}")
        device = self.block_tables.pop(request.request_id, [])
        self._forget_hashes(request.request_id)
        if self.tier is not None:
            self.tier.make_room(len(device))
        host = self.host_pool.allocate(len(device))
        self.host_tables[request.request_id] = host
        self.pool.free(list(reversed(device)))
        return [(d.block_id, h.block_id) for d, h in zip(device, host)]

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Give a swapped request device blocks for its saved KV plus `num_new_tokens`; returns
        (host, device) copy pairs, or None and changes nothing if the pool cannot."""
        host = self.host_tables[request.request_id]
        needed = max(cdiv(request.num_computed_tokens + num_new_tokens, self.block_size), len(host))
        if needed > self.pool.num_free_blocks:
            return None
        device = self.pool.allocate(needed)
        self.block_tables[request.request_id] = device
        del self.host_tables[request.request_id]
        if self.tier is not None:
            self.tier.release_after_step(host)  # this step's offloads must not land on them
        else:
            self.host_pool.free(host)
        return [(h.block_id, d.block_id) for h, d in zip(host, device)]
