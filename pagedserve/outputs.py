"""vLLM-shaped outputs: RequestOutput with one CompletionOutput per parallel sample.

For a streaming (DELTA) request each RequestOutput carries only what is new since the
previous one; otherwise one RequestOutput carries everything, once, at the end.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.outputs import RequestMetrics, TokenLogprobs
from pagedserve.core.request import FinishReason


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None  # per token
    finish_reason: FinishReason | None = None     # a str enum: "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: list[RequestMetrics] = field(default_factory=list)  # one per sample, when finished
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    # (nothing predicts it). Streaming: on the first output only.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache served (vLLM's field; known once finished)."""
        return max((m.num_cached_tokens for m in self.metrics), default=0)


__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput"]
