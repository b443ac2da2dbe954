"""The prefix cache never serves KV computed from another prefix, even when block keys collide.

Keys are SHA-256 (a collision is out of reach); to test what happens if one happened anyway,
the tests swap in deliberately weak hash functions and check, block by block, that every
block served was computed from exactly the tokens of the prefix asking for it.
"""
from __future__ import annotations

import hashlib
import struct

import pytest

import pagedserve.core.kv_cache as kv_cache
from checkpoints import hf_greedy
from pagedserve import LLM, SamplingParams
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache import KVCacheManager
from pagedserve.core.request import Request

BS = 2  # tokens per block: small, so a few tokens make several blocks


def constant_hash(parent, block):
    return b"same key for every block"


def parent_blind_hash(parent, block):
    """Keys a block by its own tokens only: different prefixes ending in equal blocks collide."""
    return ("tokens only", bytes(block) if isinstance(block, bytes) else tuple(block))


class Harness:
    """Drives the KV manager as the scheduler does, and records for each block the token
    prefix its KV was computed from (what a model would have written into it)."""

    def __init__(self, num_blocks: int = 16, **manager_args) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.kv = KVCacheManager(self.pool, BS, **manager_args)
        self.computed_from: dict[int, tuple[int, ...]] = {}

    def run(self, rid: str, tokens: list[int], keep: bool = False) -> int:
        """Prefill `tokens`; asserts every cache hit holds this prompt's own prefix. Returns hits."""
        req = Request(rid, tokens, SamplingParams(max_tokens=1))
        hits, num_hit_tokens = self.kv.get_computed_blocks(req)
        for i, block_id in enumerate(hits):
            assert self.computed_from[block_id] == tuple(tokens[:(i + 1) * BS]), (
                f"{rid}: block {i} served KV computed from {self.computed_from[block_id]}, "
                f"not from its own prefix {tuple(tokens[:(i + 1) * BS])}")
        assert self.kv.allocate_slots(req, len(tokens) - num_hit_tokens, num_hit_tokens, hits) is not None
        table = self.kv.block_tables[rid]
        for i in range(len(hits), len(table)):
            self.computed_from[table[i].block_id] = tuple(tokens[:(i + 1) * BS])
        req.num_computed_tokens = len(tokens)
        self.kv.cache_blocks(req, len(tokens))
        if not keep:
            self.kv.free(req)
        return len(hits)


@pytest.fixture(params=[constant_hash, parent_blind_hash], ids=["constant", "parent-blind"])
def weak_hash(request, monkeypatch):
    monkeypatch.setattr(kv_cache, "chain_hash", request.param)
    return request.param


def test_block_keys_are_sha256_of_the_parent_key_and_the_packed_tokens():
    h = Harness(extra_keys_for=lambda req: b"lora:7" if req.request_id == "b" else b"")
    tokens = [11, 2 ** 40, 13, 14, 15]
    h.run("a", tokens, keep=True)
    h.run("b", tokens, keep=True)

    def sha(*parts):
        return hashlib.sha256(b"".join(parts)).digest()

    def packed(ids):
        return struct.pack(f"={len(ids)}q", *ids)

    root = bytes(32)
    a0 = sha(root, packed(tokens[:2]))
    a1 = sha(a0, packed(tokens[2:4]))
    b0 = sha(root, packed(tokens[:2]), b"lora:7")  # extra keys enter the first block's key...
    b1 = sha(b0, packed(tokens[2:4]))               # ...and through it every later one
    assert set(h.pool.hash_to_block) == {a0, a1, b0, b1}


def test_extra_keys_keep_requests_with_the_same_tokens_apart():
    salt = {"a": b"lora:1", "b": b"lora:2", "c": b"lora:1"}
    h = Harness(extra_keys_for=lambda req: salt[req.request_id])
    tokens = [5, 6, 7, 8, 9]
    assert h.run("a", tokens) == 0
    assert h.run("b", tokens) == 0  # same tokens, other adapter: its KV differs
    assert h.run("c", tokens) == 2  # same adapter: shared


def test_a_colliding_key_serves_no_other_prompts_kv(weak_hash):
    h = Harness()
    h.run("p", [1, 2, 3, 4, 99])
    h.run("q", [5, 6, 3, 4, 7, 8, 99])        # block (3,4) again, after another first block
    h.run("r", [1, 2, 3, 4, 7, 8, 99])        # block (7,8) again, after another prefix
    h.run("s", [3, 4, 1, 2, 99])
    assert h.run("p2", [1, 2, 3, 4, 99]) >= 1  # collisions cost hits, not all of them


def test_a_reused_parent_block_does_not_revive_its_old_children(monkeypatch):
    """A cached child outlives its parent block being handed out again; if the parent's new
    tokens collide with the old ones' key position, the child must not look like their
    continuation (blocks record their parent's epoch, not only its identity)."""
    monkeypatch.setattr(kv_cache, "chain_hash", parent_blind_hash)
    h = Harness(num_blocks=6)
    h.run("p", [1, 2, 3, 4, 99])
    p0, p1 = (next(b for b in h.pool.blocks if b.block_hash is not None and h.computed_from.get(b.block_id) == prefix)
              for prefix in [(1, 2), (1, 2, 3, 4)])
    h.pool.touch(p1)  # keep P1 cached and out of the free queue
    others = h.pool.allocate(h.pool.num_free_blocks)  # evicts P0
    h.pool.free([p0] + [b for b in others if b is not p0])  # P0's block is handed out first again
    h.pool.free([p1])
    h.run("x", [5, 6, 3, 4, 99])  # its first block lands in P0's old block, next to P1
    assert h.computed_from[p0.block_id] == (5, 6)
    h.run("y", [5, 6, 3, 4, 7, 8, 99])


def test_llm_with_a_constant_hash_still_matches_hf(tiny_llama, monkeypatch):
    """End to end: every block key collides, prompts run one after another so each could be
    served the previous ones' KV; greedy output must still equal HF's."""
    monkeypatch.setattr(kv_cache, "chain_hash", constant_hash)
    prompts = [[7, 8, 9, 10] * 10, [20, 21, 22] * 12, [7, 8, 9, 10] * 10]
    ref = hf_greedy(tiny_llama, prompts, [6, 6, 6])
    llm = LLM(str(tiny_llama), num_kv_blocks=64, preemption_mode="recompute", enable_prefix_caching=True)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for prompt, want in zip(prompts, ref):
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert llm.engine.kv_cache_manager.prefix_hits > 0  # the repeated prompt still hit its first block
