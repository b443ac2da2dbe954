"""The messages between the API process and the engine-core process (ZMQ, msgpack via msgspec):
requests and aborts go to the core; the core answers once with ReadyMsg, then one OutputsMsg
per step, or a DeadMsg. Positional (array_like) encoding keeps a 32-decode step small."""
from __future__ import annotations

import msgspec

from pagedserve.core.outputs import EngineCoreOutputs
from pagedserve.core.request import EngineCoreRequest, RequestStatus


class AddMsg(msgspec.Struct, tag="add", array_like=True):
    requests: list[EngineCoreRequest]


class FinishMsg(msgspec.Struct, tag="finish", array_like=True):
    request_ids: list[str]
    status: RequestStatus
    stop_reason: int | str | None = None


class ShutdownMsg(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class ReadyMsg(msgspec.Struct, tag="ready", array_like=True):
    snapshot: EngineCoreOutputs
    pid: int
    worker_pids: list[int]


class OutputsMsg(msgspec.Struct, tag="out", array_like=True):
    outputs: EngineCoreOutputs
    num_received: int   # requests the core has taken in so far (the rest are in flight)


class DeadMsg(msgspec.Struct, tag="dead", array_like=True):
    error: str
    bad_config: bool = False   # a ValueError at start-up: the user's knob, not a crash


ToCore = AddMsg | FinishMsg | ShutdownMsg
FromCore = ReadyMsg | OutputsMsg | DeadMsg
ENCODER = msgspec.msgpack.Encoder()
TO_CORE_DECODER = msgspec.msgpack.Decoder(ToCore)
FROM_CORE_DECODER = msgspec.msgpack.Decoder(FromCore)
