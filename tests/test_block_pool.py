from __future__ import annotations

import pytest

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.sampling import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams())


def test_allocate_free_and_lru_order():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert [x.block_id for x in a + b] == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(5 / 6)
    pool.free(b[::-1])
    pool.free(a)
    # freed blocks join the tail in the order given; block 5 was never used and comes first
    assert [x.block_id for x in pool.free_queue] == [5, 4, 3, 2, 0, 1]
    with pytest.raises(RuntimeError):
        pool.free(a)  # double free is caught
    with pytest.raises(RuntimeError):
        pool.allocate(7)


def test_allocate_slots_takes_only_what_tokens_need_and_fails_cleanly():
    pool = BlockPool(4)
    kv = KVCacheManager(pool, block_size=4)
    r = req("a", list(range(5)))
    assert kv.allocate_slots(r, 5) is not None  # 5 tokens -> 2 blocks
    assert kv.num_blocks_held("a") == 2
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 3) is not None  # tokens 6..8 still fit block 2
    assert kv.num_blocks_held("a") == 2
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 1) is not None  # token 9 needs a third block
    assert kv.num_blocks_held("a") == 3
    other = req("b", list(range(9)))
    before = (pool.num_free_blocks, dict(kv.block_tables))
    assert kv.allocate_slots(other, 9) is None  # needs 3, 1 free: nothing changes
    assert (pool.num_free_blocks, dict(kv.block_tables)) == before
    kv.free(r)
    assert pool.num_free_blocks == 4


def test_prefix_cache_reuse_and_eviction():
    pool = BlockPool(4, enable_caching=True)
    kv = KVCacheManager(pool, block_size=2)
    first = req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(first, 5) is not None
    first.num_computed_tokens = 5
    kv.cache_blocks(first, 5)               # blocks [1,2] and [3,4] are full
    kv.free(first)
    assert pool.num_free_blocks == 4 and len(pool.hash_to_block) == 2
    second = req("b", [1, 2, 3, 4, 9, 9])
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert len(hits) == 2 and num_hit_tokens == 4
    assert kv.allocate_slots(second, 2, num_hit_tokens, hits) is not None
    assert [b.block_id for b in kv.block_tables["b"][:2]] == hits
    assert all(pool.blocks[i].ref_cnt == 1 for i in hits)
    # the last token is never served from cache
    assert len(kv.get_computed_blocks(req("c", [1, 2, 3, 4]))[0]) == 1
    kv.free(second)
    # allocating everything evicts all cached hashes
    pool.allocate(4)
    assert not pool.hash_to_block


@pytest.mark.parametrize("reuse_recent_first", [False, True])
def test_blocks_are_made_when_first_taken_and_the_order_is_that_of_a_full_queue(reuse_recent_first):
    """A 4 GiB swap space is ~half a million blocks, most never used: the pool makes a block the
    first time it is handed out (a full list cost 0.7 s of CPU per engine start and made every
    full garbage collection walk it). The order blocks come out in is that of a queue holding
    them all from the start: LRU takes the never-used ones first, lowest id first; a stack
    takes the last freed first, then the never-used ones lowest id first."""
    n = 200_000
    pool = BlockPool(n, reuse_recent_first=reuse_recent_first)
    made = sum(b is not None for b in pool.blocks._fresh.made)
    assert made == 0 and pool.num_free_blocks == n
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    pool.free([a[1]])
    nxt = pool.allocate(2)
    assert [b.block_id for b in nxt] == ([3, 4] if not reuse_recent_first else [1, 3])
    assert sum(b is not None for b in pool.blocks._fresh.made) == (5 if not reuse_recent_first else 4)
    assert pool.num_free_blocks == n - 4
    # the queue as a reader sees it: every free block, in the order they would be taken
    small = BlockPool(5, reuse_recent_first=reuse_recent_first)
    x = small.allocate(2)
    small.free([x[0]])
    order = [b.block_id for b in small.free_queue]
    assert order == ([2, 3, 4, 0] if not reuse_recent_first else [4, 3, 2, 0])
    assert small.blocks[4].block_id == 4 and len(small.blocks) == 5
