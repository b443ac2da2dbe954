"""Which replica serves a request: pure policy, torch-free, the same code behind the Ray Serve
application (fleet/serve.py) and the simulator's fleet (sim/fleet.py).

A router knows, per live replica, what it has itself sent there and not yet seen finish (its
in-flight count: exact, never stale), the last queue and KV usage the replica reported, and, for
the kv-aware policy, the set of prefix-cache keys the replica's pool can serve, rebuilt from the
replica's KV events (core/kv_events.py in-process, or the vLLM-format batches of
engine/kv_events.py off a ZMQ socket: both carry `block_hashes` under the same class names).

A request's keys are computed from its token ids exactly as the engine's KV manager computes them
(core/kv_cache.py `block_content` + `chain_hash`, then the event's 64-bit cut
`external_block_hash`), over the full blocks the engine could serve from cache (never the last
token). So "replica r holds n blocks of this prompt" is the engine's own answer, not a guess from
text.

Policies (`make_router(name)`):
- round-robin: live replicas in turn;
- power-of-two: two distinct replicas drawn at random, the one with less load (in-flight plus
  reported waiting);
- kv-aware: the replica holding the longest cached prefix of the prompt, among the replicas not
  overloaded: load at most `imbalance_threshold` above the least-loaded replica's and KV usage
  below `kv_usage_limit`; when no candidate holds any of it (or every holder is overloaded), the
  least-loaded replica. The bound keeps a hot prefix from piling every request onto one replica.

Invariants: a replica the router has forgotten (death, `AllBlocksCleared`) holds no keys; every
decision names a live replica; the same calls in the same order give the same decisions (the
power-of-two draw comes from a seeded generator).
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Collection, Iterable, Sequence

from pagedserve.core.kv_cache import block_content, chain_hash
from pagedserve.core.kv_events import external_block_hash

ROUTERS = ("round-robin", "power-of-two", "kv-aware")

# kv-aware defaults. A replica more than this many requests above the least-loaded one is not
# chosen for its cache (Ray's PrefixCacheAffinityRouter and llm-d's load scorer bound it alike).
DEFAULT_IMBALANCE_THRESHOLD = 8
# Above this share of its pool held by requests a replica is about to preempt: a cache hit there
# would cost more than the prefill it saves.
DEFAULT_KV_USAGE_LIMIT = 0.95


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, first_block_extra: bytes = b"") -> list[int]:
    """The external keys (vLLM's int ExternalBlockHash) of the prompt's full blocks that the
    engine could serve from its prefix cache: all but the last token, in blocks of `block_size`.
    `first_block_extra`: what besides its tokens a first block's key covers (the engine's
    `prefix_extra_keys`, e.g. a long-context RoPE's; b"" for most models)."""
    num_full = max(len(token_ids) - 1, 0) // block_size
    out, parent = [], None
    for i in range(num_full):
        content = block_content(token_ids[i * block_size:(i + 1) * block_size], first_block_extra if i == 0 else b"")
        parent = chain_hash(parent, content)
        out.append(external_block_hash(parent))
    return out


@dataclass
class ReplicaState:
    """What the router knows of one replica."""
    replica_id: str
    in_flight: int = 0            # routed here, not yet finished (the router's own count)
    num_waiting: int = 0          # last reported
    num_running: int = 0          # last reported
    kv_usage: float = 0.0         # last reported, 0..1
    cached: set[int] = field(default_factory=set)   # prefix-cache keys its pool can serve

    @property
    def load(self) -> int:
        return max(self.in_flight, self.num_running + self.num_waiting)


@dataclass(frozen=True)
class Decision:
    replica_id: str
    matched_blocks: int           # blocks of the prompt the chosen replica holds (kv-aware; else 0)
    reason: str                   # round-robin | power-of-two | prefix | least-loaded | overloaded-holder


class Router:
    """The state every policy shares; `choose` is the policy."""

    name = "base"

    def __init__(self, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.replicas: dict[str, ReplicaState] = {}
        self.rng = random.Random(seed)

    # -- membership ---------------------------------------------------------------------
    def add_replica(self, replica_id: str) -> None:
        self.replicas.setdefault(replica_id, ReplicaState(replica_id))

    def remove_replica(self, replica_id: str) -> None:
        """The replica died or left: forget it and everything it held."""
        self.replicas.pop(replica_id, None)

    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        """Make the live set exactly `replica_ids` (new ones start empty, gone ones are forgotten)."""
        ids = list(replica_ids)
        for gone in set(self.replicas) - set(ids):
            self.remove_replica(gone)
        for replica_id in ids:
            self.add_replica(replica_id)

    # -- what replicas tell us ----------------------------------------------------------
    def apply_events(self, replica_id: str, events: Iterable) -> None:
        """A batch of the replica's KV events, in order (core or wire classes)."""
        state = self.replicas.get(replica_id)
        if state is None:
            return
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                state.cached.update(event.block_hashes)
            elif kind == "BlockRemoved":
                state.cached.difference_update(event.block_hashes)
            elif kind == "AllBlocksCleared":
                state.cached.clear()

    def report_load(self, replica_id: str, num_waiting: int, num_running: int, kv_usage: float) -> None:
        state = self.replicas.get(replica_id)
        if state is not None:
            state.num_waiting, state.num_running, state.kv_usage = num_waiting, num_running, kv_usage

    def started(self, replica_id: str) -> None:
        if replica_id in self.replicas:
            self.replicas[replica_id].in_flight += 1

    def finished(self, replica_id: str) -> None:
        state = self.replicas.get(replica_id)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1

    # -- the policy ---------------------------------------------------------------------
    def live(self, candidates: Collection[str] | None = None) -> list[ReplicaState]:
        """The live replicas a decision may name, in id order: all, or those of `candidates`
        (Ray Serve offers the ones that can take a request now)."""
        ids = sorted(self.replicas if candidates is None else (r for r in candidates if r in self.replicas))
        if not ids:
            raise RuntimeError("no live replica to route to")
        return [self.replicas[r] for r in ids]

    def matched_blocks(self, state: ReplicaState, hashes: Sequence[int]) -> int:
        """How many of the prompt's leading blocks the replica holds (a prefix: it stops at the first miss)."""
        n = 0
        for h in hashes:
            if h not in state.cached:
                break
            n += 1
        return n

    def choose(self, token_ids: Sequence[int], candidates: Collection[str] | None = None) -> Decision:
        raise NotImplementedError

    def least_loaded(self, states: Sequence[ReplicaState]) -> ReplicaState:
        return min(states, key=lambda s: (s.load, s.kv_usage))


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self, block_size: int, seed: int = 0) -> None:
        super().__init__(block_size, seed)
        self._counter = itertools.count()

    def choose(self, token_ids: Sequence[int], candidates: Collection[str] | None = None) -> Decision:
        live = self.live(candidates)
        return Decision(live[next(self._counter) % len(live)].replica_id, 0, "round-robin")


class PowerOfTwoRouter(Router):
    name = "power-of-two"

    def choose(self, token_ids: Sequence[int], candidates: Collection[str] | None = None) -> Decision:
        live = self.live(candidates)
        picks = self.rng.sample(live, 2) if len(live) >= 2 else live
        return Decision(self.least_loaded(picks).replica_id, 0, "power-of-two")


class KVAwareRouter(Router):
    name = "kv-aware"

    def __init__(self, block_size: int, seed: int = 0, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                 kv_usage_limit: float = DEFAULT_KV_USAGE_LIMIT, first_block_extra: bytes = b"") -> None:
        super().__init__(block_size, seed)
        if imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold: must be >= 0, got {imbalance_threshold}")
        self.imbalance_threshold = imbalance_threshold
        self.kv_usage_limit = kv_usage_limit
        self.first_block_extra = first_block_extra

    def choose(self, token_ids: Sequence[int], candidates: Collection[str] | None = None) -> Decision:
        live = self.live(candidates)
        hashes = prompt_block_hashes(token_ids, self.block_size, self.first_block_extra)
        matched = {s.replica_id: self.matched_blocks(s, hashes) for s in live}
        floor = min(s.load for s in live)
        fit = [s for s in live if s.load <= floor + self.imbalance_threshold and s.kv_usage < self.kv_usage_limit]
        best = max(fit, key=lambda s: (matched[s.replica_id], -s.load, -s.kv_usage), default=None)
        if best is not None and matched[best.replica_id] > 0:
            return Decision(best.replica_id, matched[best.replica_id], "prefix")
        target = self.least_loaded(fit or live)
        reason = "overloaded-holder" if any(matched.values()) else "least-loaded"
        return Decision(target.replica_id, matched[target.replica_id], reason)


def make_router(name: str, block_size: int, seed: int = 0, **kwargs) -> Router:
    """A router by its flag name (ROUTERS); kv-aware takes imbalance_threshold, kv_usage_limit."""
    if name == "round-robin":
        return RoundRobinRouter(block_size, seed)
    if name == "power-of-two":
        return PowerOfTwoRouter(block_size, seed)
    if name == "kv-aware":
        return KVAwareRouter(block_size, seed, **kwargs)
    raise ValueError(f"router: must be one of {ROUTERS}, got {name!r}")
