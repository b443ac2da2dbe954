"""OutputProcessor: the engine core's per-step token deltas -> user-facing RequestOutputs.

It holds the front-end's state of every live request: its parallel samples (n > 1 is one
group of core requests, each knowing its parent and index), their incremental
detokenizers and stop strings, and what was already handed out. Each core step is
processed in time proportional to the tokens that step produced:

- DELTA outputs carry only what is new since the previous output (streaming);
- FINAL_ONLY outputs are built once, when every sample of the request has finished.

A stop string ends a sample here; the caller must then end its core request
(`ProcessedOutputs.stopped`), as it would an abort. A sample the core ended with
finish_reason "error" (its grammar matcher failed) is listed in `ProcessedOutputs.failed`
with a message naming the request field of its constraint: a server answers that request
with an error (and aborts its other samples); offline, its CompletionOutput carries
finish_reason "error" and the text generated before the failure. Metrics are recorded as
outputs are processed, when a sink is given.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.core.outputs import EngineCoreOutputs, RequestMetrics, TokenLogprobs
from pagedserve.core.request import FinishReason, Request
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling import SamplingParams


class OutputKind(enum.Enum):
    DELTA = "delta"            # each step: what is new
    FINAL_ONLY = "final_only"  # once, complete


@dataclass
class SampleState:
    """One sequence of a request, as the front-end sees it."""

    request: Request               # the core request (its id, params, arrival)
    parent: "RequestState"
    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0       # DELTA: tokens already handed out
    finish_sent: bool = False      # DELTA: the finish was handed out
    # What the core reported of this sequence's life, and when its tokens arrived.
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def metrics(self) -> RequestMetrics:
        return RequestMetrics(self.request.times.arrival, self.first_scheduled_time, self.first_token_time,
                              self.last_token_time, self.finished_time, self.num_preemptions,
                              self.num_cached_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    """One user request: n samples sharing a prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: OutputKind
    samples: list[SampleState] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    stopped: list[tuple[str, str]]  # (core request id, stop string): end these in the core
    # (request id, "field: message"): a sample failed (FinishReason.ERROR); fail the request
    failed: list[tuple[str, str]] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer, metrics=None) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.requests: dict[str, RequestState] = {}
        self._samples: dict[str, SampleState] = {}  # core request id -> its sample

    def __len__(self) -> int:
        return len(self.requests)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    core_requests: list[Request], kind: OutputKind) -> None:
        """Register a request and its core requests (one per sample, in index order)."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        state = RequestState(request_id, prompt, prompt_token_ids, kind)
        for index, core_req in enumerate(core_requests):
            params = core_req.sampling_params
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                               params.include_stop_str_in_output, params.skip_special_tokens,
                                               params.min_tokens)
            sample = SampleState(core_req, state, index, detok,
                                 logprobs=[] if params.logprobs is not None else None)
            state.samples.append(sample)
            self._samples[core_req.request_id] = sample
        self.requests[request_id] = state

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the core request ids still to be ended in the core."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        ids = []
        for s in state.samples:
            self._samples.pop(s.request.request_id, None)
            if not s.finished:
                ids.append(s.request.request_id)
                if self.metrics is not None:
                    self.metrics.record_finished(FinishReason.ABORT.value, len(state.prompt_token_ids),
                                                 len(s.token_ids), None)
        return ids

    def process_outputs(self, core_outputs: EngineCoreOutputs) -> ProcessedOutputs:
        touched: dict[str, RequestState] = {}
        stopped: list[tuple[str, str]] = []
        failed: list[tuple[str, str]] = []
        now = core_outputs.timestamp
        for out in core_outputs.outputs:
            sample = self._samples.get(out.request_id)
            if sample is None or sample.finished:
                continue  # aborted, or ended by a stop string while this step ran
            prev_time = sample.last_token_time
            sample.token_ids.extend(out.new_token_ids)
            sample.num_preemptions = out.num_preemptions
            if sample.first_token_time is None:
                sample.first_token_time = now
                sample.first_scheduled_time = out.first_scheduled_time
                sample.num_cached_tokens = out.num_cached_tokens
            sample.last_token_time = now
            if out.prompt_logprobs is not None:
                sample.parent.prompt_logprobs = [None] + out.prompt_logprobs
            if sample.logprobs is not None and out.new_logprobs:
                sample.logprobs.extend(out.new_logprobs)
                sample.cumulative_logprob += sum(lp.logprob for lp in out.new_logprobs)
            if sample.detok is not None:
                for token in out.new_token_ids:
                    hit = sample.detok.add_token(token)
                    if hit is not None and out.finish_reason is None:
                        sample.finish_reason, sample.stop_reason = FinishReason.STOP, hit
                        stopped.append((out.request_id, hit))
                        break
            if out.finish_reason is not None and not sample.finished:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
                if out.finish_reason == FinishReason.ERROR:
                    failed.append((sample.parent.request_id, failure_message(sample, out.error)))
                    if self.metrics is not None:
                        self.metrics.record_structured_output_error()
            if sample.finished:
                sample.finished_time = now
            self._record(sample, len(out.new_token_ids), prev_time, now)
            touched[sample.parent.request_id] = sample.parent
        outputs = []
        for state in touched.values():
            request_output = self._make_output(state)
            if request_output is not None:
                outputs.append(request_output)
            if state.finished:
                del self.requests[state.request_id]
                for s in state.samples:
                    self._samples.pop(s.request.request_id, None)
        return ProcessedOutputs(outputs, stopped, failed)

    def _record(self, sample: SampleState, num_new: int, prev_time: float | None, now: float) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        num_prompt = len(sample.parent.prompt_token_ids)
        if num_new:
            if prev_time is None:
                metrics.record_first_token(num_prompt, sample.request.times.arrival, now)
                metrics.record_new_tokens(num_new, None)
            else:
                metrics.record_new_tokens(num_new, now - prev_time)
        if sample.finished:
            metrics.record_finished(sample.finish_reason.value, num_prompt, len(sample.token_ids), sample.metrics)

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        finished = state.finished
        if state.kind == OutputKind.FINAL_ONLY:
            if not finished:
                for s in state.samples:  # keep each detokenizer's held text bounded
                    if s.detok is not None:
                        s.detok.take_new_text(False)
                return None
            comps = [self._final(s) for s in state.samples]
        else:
            comps = [c for s in state.samples if (c := self._delta(s)) is not None]
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            prompt_logprobs, state.prompt_logprobs_sent = state.prompt_logprobs, True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, comps, finished,
                             [s.metrics for s in state.samples] if finished else [], prompt_logprobs)

    def _final(self, s: SampleState) -> CompletionOutput:
        if s.detok is not None:
            _take_text(s, True)
        return CompletionOutput(
            index=s.index, text=s.detok.text if s.detok is not None else "", token_ids=s.token_ids,
            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
            logprobs=s.logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason)

    def _delta(self, s: SampleState) -> CompletionOutput | None:
        """What is new since the last output: tokens, text, logprobs, and the finish once."""
        new_tokens = s.token_ids[s.num_sent_tokens:]
        if not new_tokens and (not s.finished or s.finish_sent):
            return None
        text = _take_text(s, s.finished) if s.detok is not None else ""
        new_lps = s.logprobs[s.num_sent_tokens:] if s.logprobs is not None else None
        s.num_sent_tokens = len(s.token_ids)
        s.finish_sent = s.finished
        return CompletionOutput(
            index=s.index, text=text, token_ids=new_tokens,
            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
            logprobs=new_lps, finish_reason=s.finish_reason, stop_reason=s.stop_reason)

def _take_text(s: SampleState, finished: bool) -> str:
    """The sample's new text; a stop string that only its detokenizer's last text held (a
    tokenizer that cleans up spaces) makes the finish a stop, as it would have been mid-stream."""
    text = s.detok.take_new_text(finished)
    if finished and s.detok.flush_stop is not None and s.finish_reason != FinishReason.STOP:
        s.finish_reason, s.stop_reason = FinishReason.STOP, s.detok.flush_stop
    return text


def failure_message(sample: SampleState, error: str | None) -> str:
    """'field: ...': what the client is told when a sample's grammar matcher failed."""
    spec = sample.request.sampling_params.structured_outputs
    where = spec.field if spec is not None else "request"
    return (f"{where}: the constraint could not be enforced: the grammar engine failed after "
            f"{len(sample.token_ids)} generated tokens ({error or 'no detail'}); no output is returned "
            f"rather than unconstrained text")


def make_core_requests(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       eos_token_ids: frozenset[int], arrival_time: float | None, priority: int,
                       max_model_len: int) -> list[Request]:
    """One core request per sample. A single sample keeps the request's id; samples of a
    group get distinct ids that the OutputProcessor maps back (never parsed)."""
    if params.n == 1:
        return [Request(request_id, prompt_token_ids, params, eos_token_ids, arrival_time, priority, max_model_len)]
    return [Request(f"{i}:{request_id}", prompt_token_ids, params.child(i), eos_token_ids, arrival_time, priority,
                    max_model_len) for i in range(params.n)]
