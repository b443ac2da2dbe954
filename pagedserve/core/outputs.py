"""What crosses the engine core's boundaries, as plain torch-free data.

    executor  -> core:      StepResult         (sampled token and logprobs per request that sampled,
                                                prompt logprobs per prefill chunk that scored any)
    core -> front-end:      EngineCoreOutputs  (per-request deltas of one step + that step's stats)

Deltas only: an output carries the tokens a request gained in this step, never its whole
history, so a step costs the same at the 10th and the 10,000th token.

They are msgspec Structs (plain data, no torch) because they cross process boundaries
every step: EngineCoreOutputs from the engine-core process to the API process, StepResult
from rank 0 to the engine core. Encoded positionally (array_like) by msgspec, a step of 32
decodes round-trips in about a third of pickle's time (benchmarks/scaleout.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from msgspec import Struct, field

from pagedserve.core.request import FinishReason


class TokenLogprobs(Struct, array_like=True):
    token_id: int
    logprob: float
    rank: int                       # 1 = most likely
    top: list[tuple[int, float]]    # the `logprobs` most likely (id, logprob)


class StepResult(Struct, array_like=True):
    """What an executor returns for one SchedulerOutput: the real model runner and the
    simulator's cost model both produce it."""

    sampled: dict[str, int] = field(default_factory=dict)   # request id -> token, for requests that sampled
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> logprobs of the prompt tokens this step's chunk predicted, in order
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    duration: float = 0.0          # seconds spent in execute()
    forward_time: float = 0.0      # of which in the model forward + sampling
    # request id -> why it cannot go on (its grammar matcher failed): it samples nothing this
    # step and the scheduler ends it with FINISHED_ERROR
    errors: dict[str, str] = field(default_factory=dict)
    # The disk tier: why its copies failed this step ("" = they did not), and the slots whose
    # reads came back torn, corrupted or of another key (missed, never served)
    disk_error: str = ""
    disk_failed_reads: list[int] = field(default_factory=list)


class SchedulerStats(Struct, array_like=True):
    """One step, as the scheduler saw it. Counts (preemptions, swaps, prefix lookups) are this
    step's; queue and pool fields are the state after the step."""

    num_batched_tokens: int = 0      # tokens computed this step (prefill chunks + decodes)
    num_prefill_tokens: int = 0      # of which prompt (or recomputed) tokens
    num_decode_tokens: int = 0       # of which decodes (one per running sequence)
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_usage: float = 0.0
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    num_total_tokens: int = 0
    num_preempted: dict[str, int] = field(default_factory=dict)  # by mode
    num_recomputed_tokens: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0
    # The host KV tier (--kv-offloading-size): prompt tokens of requests that looked past the
    # device pool, tokens loaded from the tier instead of computed (vLLM's
    # external_prefix_cache_queries / _hits), blocks copied out and in, and its state after the step.
    # Prompt tokens that missed (pool and tier) on a prefix the cache had held and evicted.
    prefix_cache_evicted_hits: int = 0
    tier_queries: int = 0
    tier_hits: int = 0
    num_blocks_offloaded: int = 0
    num_blocks_loaded: int = 0
    tier_used_blocks: int = 0
    tier_total_blocks: int = 0


@dataclass
class RequestMetrics:
    """One sequence's life, assembled by the front-end when it finishes."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_preemptions: int
    num_cached_tokens: int


class EngineCoreOutput(Struct, array_like=True, omit_defaults=True):
    """What one request gained in one step (the step's time is EngineCoreOutputs.timestamp)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # on a request's first output only
    num_cached_tokens: int = 0                 # on a request's first output only
    arrival_time: float | None = None          # on a request's first output only (TTFT without a lookup)
    # On a request's first output only, when it asked for them: prompt tokens 1.. (token 0 has none).
    prompt_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None                   # with finish_reason ERROR: what failed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(Struct, array_like=True):
    """One engine step: the per-request deltas, the step's stats and timings."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    timestamp: float = 0.0          # the core's clock at the end of the step
    step_time: float = 0.0          # wall seconds of the whole step (schedule, execute, update)
    execute_time: float = 0.0       # of which in the executor
    forward_time: float = 0.0       # of which in the model forward + sampling
    # KV events (--kv-events-config) the engine-core loop's publisher has sent and dropped so
    # far (cumulative; both 0 when KV events are off).
    kv_events_published: int = 0
    kv_events_dropped: int = 0
