"""A request's state as the engine core sees it, and its timestamps for metrics.

One request is one sequence: a parallel-sampling group (n > 1) is several requests, tied
together by the front-end (engine/output_processor.py), never by parsing their ids.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from msgspec import Struct

from pagedserve.sampling import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a sequence ended, spelled as the OpenAI API spells `finish_reason`."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # the request could not be honoured (its grammar matcher failed): the client gets an error

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
                   RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
                   RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
                   RequestStatus.FINISHED_ERROR: FinishReason.ERROR}


@dataclass
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


class Request:
    """One sequence. Prefill and decode are the same thing here: the scheduler grants
    `num_tokens - num_computed_tokens` new tokens (or a chunk of them) each step."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), arrival_time: float | None = None,
                 priority: int = 0, max_model_len: int | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.max_model_len = max_model_len
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Prompt logprobs the executor reported, held until the first token goes out with them.
        self.prompt_logprobs: list | None = [] if sampling_params.prompt_logprobs is not None else None
        self.times = RequestTimes(arrival=time.monotonic() if arrival_time is None else arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy: O(output length). The step never needs it; tests and reports do."""
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def skips_prefix_cache(self) -> bool:
        """A cached prefix has no logits: a request that wants its prompt scored computes it all."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def max_tokens(self) -> int:
        limit = self.sampling_params.max_tokens
        room = (self.max_model_len - self.num_prompt_tokens) if self.max_model_len else None
        if limit is None:
            return room if room is not None else 2**31
        return limit if room is None else min(limit, room)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, out={self.num_output_tokens})")


class EngineCoreRequest(Struct, array_like=True):
    """One sequence as the front-end hands it to an engine core in another process: plain
    data (the wire format of engine/core_client.py). The core makes its Request from it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    max_model_len: int | None = None

    @classmethod
    def of(cls, req: Request) -> "EngineCoreRequest":
        return cls(req.request_id, req.prompt_token_ids, req.sampling_params, sorted(req.eos_token_ids),
                   req.times.arrival, req.priority, req.max_model_len)

    def to_request(self) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.sampling_params,
                       frozenset(self.eos_token_ids), self.arrival_time, self.priority, self.max_model_len)
