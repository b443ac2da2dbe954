"""The messages into and out of the engine-core loop (engine/core_loop.py). In process mode
they cross ZMQ as msgpack (msgspec); in thread mode the same objects go through an in-memory
inbox, so both modes run one loop fed by one vocabulary. Positional (array_like) encoding
keeps a 32-decode step small.

    to the core:    AddMsg, FinishMsg, PauseMsg, ResumeMsg, WatchPoolMsg, ShutdownMsg
    from the core:  ReadyMsg once (process mode), then OutputsMsg per step, SnapshotMsg when
                    a watched pool view is due, or DeadMsg
"""
from __future__ import annotations

import msgspec

from pagedserve.core.outputs import EngineCoreOutputs
from pagedserve.core.request import EngineCoreRequest, RequestStatus
from pagedserve.core.snapshot import PoolSnapshot


class AddMsg(msgspec.Struct, tag="add", array_like=True):
    requests: list[EngineCoreRequest]


class FinishMsg(msgspec.Struct, tag="finish", array_like=True):
    request_ids: list[str]
    status: RequestStatus
    stop_reason: int | str | None = None


class PauseMsg(msgspec.Struct, tag="pause", array_like=True):
    """Hold the loop between two steps: it steps no more and applies nothing but control
    messages (resume, shutdown, pool watching) until ResumeMsg."""


class ResumeMsg(msgspec.Struct, tag="resume", array_like=True):
    pass


class WatchPoolMsg(msgspec.Struct, tag="watch", array_like=True):
    """How many pages watch the pool now, and the rate/CPU bounds for their snapshots
    (core/snapshot.py SnapshotGate); 0 watchers: no snapshots are taken."""

    watchers: int
    max_rate: float = 4.0
    max_share: float = 0.01


class ShutdownMsg(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class PoolLayout(msgspec.Struct, array_like=True):
    """The pool's fixed sizes, known once the core has sized it."""

    num_blocks: int
    block_size: int
    num_host_blocks: int     # 0: no host swap pool
    bytes_per_token: int
    # this process's model, when it runs here (a one-rank core; 0 when ranks of its own hold it):
    # its weights as loaded and its device KV pool as allocated, `plan`'s per-GPU figures
    weight_bytes: int = 0
    kv_cache_bytes: int = 0


class ReadyMsg(msgspec.Struct, tag="ready", array_like=True):
    snapshot: EngineCoreOutputs
    pid: int
    worker_pids: list[int]
    layout: PoolLayout


class OutputsMsg(msgspec.Struct, tag="out", array_like=True):
    outputs: EngineCoreOutputs
    num_received: int   # requests the core has taken in so far (the rest are in flight)


class SnapshotMsg(msgspec.Struct, tag="snap", array_like=True):
    """The pool and queues after the step whose OutputsMsg went just before."""

    snapshot: PoolSnapshot


class DeadMsg(msgspec.Struct, tag="dead", array_like=True):
    error: str
    bad_config: bool = False   # a ValueError at start-up: the user's knob, not a crash


ToCore = AddMsg | FinishMsg | PauseMsg | ResumeMsg | WatchPoolMsg | ShutdownMsg
FromCore = ReadyMsg | OutputsMsg | SnapshotMsg | DeadMsg
CONTROL = (ResumeMsg, ShutdownMsg, WatchPoolMsg)  # what a paused loop still applies
ENCODER = msgspec.msgpack.Encoder()
TO_CORE_DECODER = msgspec.msgpack.Decoder(ToCore)
FROM_CORE_DECODER = msgspec.msgpack.Decoder(FromCore)
