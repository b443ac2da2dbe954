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


def merge_deltas(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive DELTA outputs of one request as one: each sample's text, token ids and
    logprobs concatenated in order; its cumulative logprob and finish from the later one; the
    prompt logprobs (sent with the first output only) kept. A stream whose consumer fell behind
    sends what queued up as one chunk (vLLM's API process merges a stream's queued outputs too)."""
    comps = {c.index: c for c in earlier.outputs}
    for c in later.outputs:
        prev = comps.get(c.index)
        if prev is not None:
            logprobs = None
            if prev.logprobs is not None or c.logprobs is not None:
                logprobs = (prev.logprobs or []) + (c.logprobs or [])
            c = CompletionOutput(c.index, prev.text + c.text, prev.token_ids + c.token_ids, c.cumulative_logprob,
                                 logprobs, c.finish_reason, c.stop_reason)
        comps[c.index] = c
    prompt_logprobs = earlier.prompt_logprobs if earlier.prompt_logprobs is not None else later.prompt_logprobs
    return RequestOutput(later.request_id, later.prompt, later.prompt_token_ids,
                         sorted(comps.values(), key=lambda c: c.index), later.finished, later.metrics,
                         prompt_logprobs)


__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput", "merge_deltas"]
