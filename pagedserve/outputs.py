"""vLLM-shaped outputs: RequestOutput with one CompletionOutput per parallel sample."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list | None = None       # per token: TokenLogprobs
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    stop_reason: int | str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_preemptions: int
    num_cached_tokens: int


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: list[RequestMetrics] = field(default_factory=list)  # one per sample

    @property
    def num_cached_tokens(self) -> int:
        return max((m.num_cached_tokens for m in self.metrics), default=0)
