"""What every endpoint does with a request before and after the engine: the checks (model
name, sampling values, output constraints, sequence bounds, then InputProcessor's, the one
place the request checks are written), SamplingParams assembly, tokenization on the
tokenizer thread, submit, and the results queue."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request

from pagedserve.engine.async_llm import AsyncLLM, EngineDead, EngineOverloaded, ServerShuttingDown
from pagedserve.engine.output_processor import OutputKind
from pagedserve.outputs import RequestOutput, merge_deltas
from pagedserve.sampling import SamplingParams
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.protocol import RETRY_AFTER_SECONDS
from pagedserve.server.request_trace import RequestTrace, received, request_trace_path
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.structured.tool_parsers import get_tool_parser


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


def count_prompts(prompt) -> int:
    """How many prompts a completions `prompt` holds (a string or a token-id list is one),
    counted without tokenizing; malformed forms count 1 and are refused by completion_prompts."""
    if isinstance(prompt, str) or not isinstance(prompt, list) or not prompt:
        return 1
    return 1 if all(isinstance(x, int) for x in prompt) else len(prompt)


class RequestHandling:
    """OpenAIServer's base: its settings, the checks, prompts, submit and results."""

    def __init__(self, async_engine: AsyncLLM, enable_prompt_tokens_details: bool = False,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 max_seqs_per_request: int | None = None) -> None:
        self.async_engine = async_engine
        self.max_seqs_per_request = max_seqs_per_request  # None: no limit
        self.engine = async_engine.engine
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("tool_call_parser: --enable-auto-tool-choice needs --tool-call-parser")
        if tool_call_parser is not None:
            get_tool_parser(tool_call_parser)  # refuses an unknown name now, not at the first request
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.model_name = self.engine.model_name
        self.created = int(time.time())
        # One thread: the tokenizer is not made for concurrent calls, and the loop must not wait on it.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-tokenizer")
        trace_path = self.engine.config.step_trace_path
        self.request_trace = RequestTrace(request_trace_path(trace_path)) if trace_path else None

    def trace_arrival(self, rid: str, request: Request) -> None:
        """Streamed requests, with --step-trace-path: note when the HTTP request came and when it
        is handed to the engine (just before submit), for the request trace."""
        if self.request_trace is not None:
            self.request_trace.arrived(rid, received(request))

    async def off_loop(self, fn, *args):
        """Run a tokenizing call on the tokenizer thread (a long prompt never stalls the loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    # -- checks ----------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def logit_bias(self, body) -> dict[int, float] | None:
        """OpenAI's {"token id": bias}: keys that are token ids, biases in [-100, 100], <= 300
        entries (ids past the vocabulary: InputProcessor.validate, with every request check)."""
        if body.logit_bias is None:
            return None
        bias = {}
        for key, value in body.logit_bias.items():
            if not key.strip().isdigit():
                raise APIError(400, f"logit_bias: {key!r} is not a token id", "logit_bias")
            bias[int(key)] = value
        return bias

    def structured_constraint(self, body, tool_constraint: StructuredOutputsParams | None = None
                              ) -> StructuredOutputsParams | None:
        """The one text constraint a request asks for, from whichever field it used."""
        found: list[tuple[str, dict]] = []
        rf = body.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format.json_schema.schema: required for type json_schema",
                               "response_format.json_schema.schema")
            found.append(("response_format.json_schema.schema", {"json": rf.json_schema.schema_}))
        so = body.structured_outputs
        if so is not None:
            spec = {k: v for k, v in {"json": so.json_, "regex": so.regex, "choice": so.choice,
                                       "grammar": so.grammar, "json_object": so.json_object}.items() if v is not None}
            if so.disable_additional_properties is not None:
                if so.json_ is None:
                    raise APIError(400, "structured_outputs.disable_additional_properties: applies to a json "
                                   "schema only", "structured_outputs.disable_additional_properties")
                spec["disable_additional_properties"] = so.disable_additional_properties
            found.append(("structured_outputs", spec))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(body, name) is not None:
                found.append((name, {kind: getattr(body, name)}))
        if tool_constraint is not None and found:
            raise APIError(400, f"{found[0][0]}: cannot be combined with a tool_choice that calls a tool",
                           found[0][0].split(".")[0])
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise APIError(400, f"{found[1][0]}: give one output constraint, got {names}", found[1][0])
        if tool_constraint is not None:
            return tool_constraint
        if not found:
            return None
        field, spec = found[0]
        try:
            return StructuredOutputsParams(**spec, field=field)
        except ValueError as e:
            raise bad_request(e) from None

    def sampling_params(self, body, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        if body.n > self.engine.config.max_num_seqs:
            raise APIError(400, f"n: at most max_num_seqs ({self.engine.config.max_num_seqs}), got {body.n}", "n")
        if body.priority != 0 and str(getattr(self.engine.config.scheduling_policy, "value",
                                                  self.engine.config.scheduling_policy)) != "priority":
            raise APIError(400, "priority: the server schedules first come, first served; start it with "
                                "--scheduling-policy priority to use priorities", "priority")
        if body.prompt_logprobs is not None:
            if body.stream:
                # As vLLM: a stream's chunks have no place for them (echo + logprobs streams the
                # prompt's logprobs inside `logprobs` on /v1/completions).
                raise APIError(400, "prompt_logprobs: not available with stream=true; send the request "
                                    "without stream", "prompt_logprobs")
            if prompt_logprobs is not None and prompt_logprobs != body.prompt_logprobs:
                raise APIError(400, "prompt_logprobs: echo with logprobs already sets it (to logprobs)",
                               "prompt_logprobs")
            prompt_logprobs = body.prompt_logprobs
        try:
            return SamplingParams(
                n=body.n,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=0 if body.top_k is None else body.top_k,
                min_p=0.0 if body.min_p is None else body.min_p,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                seed=body.seed,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                include_stop_str_in_output=body.include_stop_str_in_output,
                ignore_eos=body.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=body.skip_special_tokens,
                logit_bias=self.logit_bias(body),
                structured_outputs=structured,
            )
        except ValueError as e:
            raise bad_request(e) from None

    def check_num_seqs(self, num_prompts: int, n: int) -> None:
        """A request of more sequences (prompts x n) than one request may hold is a 400, before
        anything is tokenized; so is one larger than the whole waiting queue (it could never be
        admitted: a 503 would have the client retry forever)."""
        num_seqs = num_prompts * n
        bounds = [(self.max_seqs_per_request, "--max-seqs-per-request"),
                  (self.async_engine.max_queue_len, "--max-queue-len")]
        for bound, flag in bounds:
            if bound is not None and num_seqs > bound:
                param = "prompt" if num_prompts > 1 else "n"
                raise APIError(400, f"{param}: this request asks for {num_seqs} sequences ({num_prompts} prompt"
                                    f"{'s' if num_prompts != 1 else ''} x n={n}); the server takes at most {bound} "
                                    f"per request ({flag}); split it into smaller requests", param)

    def validate(self, prompts: list[Prompt], params: SamplingParams) -> None:
        """Every request check, in the one place they are written (InputProcessor.validate), as 400s."""
        for p in prompts:
            try:
                self.engine.input_processor.validate(p.token_ids, params)
            except ValueError as e:
                raise bad_request(e) from None

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.engine.input_processor.tokenize(text, add_special_tokens)
        except ValueError as e:
            raise bad_request(e) from None

    def decode(self, token_ids: list[int]) -> str:
        tokenizer = self.engine.tokenizer
        return "" if tokenizer is None else tokenizer.decode(token_ids)

    def completion_prompts(self, prompt) -> list[Prompt]:
        if isinstance(prompt, str):
            return [Prompt(prompt, self.tokenize_text(prompt))]
        if not prompt:
            raise APIError(400, "prompt: must not be empty", "prompt")
        if all(isinstance(x, int) for x in prompt):
            return [Prompt(None, list(prompt))]
        if all(isinstance(x, str) for x in prompt):
            return [Prompt(x, self.tokenize_text(x)) for x in prompt]
        return [Prompt(None, list(x)) for x in prompt]
    # -- running requests ------------------------------------------------------------
    def submit(self, base_id: str, prompts: list[Prompt], params: SamplingParams, priority: int,
               kind: OutputKind, received: float | None = None) -> tuple[asyncio.Queue, list[str]]:
        """`received`: when the HTTP request came (time.monotonic()); the requests' arrival, so that
        TTFT and E2E latency include parsing and tokenizing, as the client waits them."""
        ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        try:
            queue = self.async_engine.submit([(rid, p.text, p.token_ids) for rid, p in zip(ids, prompts)], params,
                                             priority, kind, arrival=received)
        except (EngineOverloaded, ServerShuttingDown) as e:
            raise APIError(503, str(e), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except EngineDead as e:
            raise APIError(503, str(e)) from None
        return queue, ids

    async def results(self, queue: asyncio.Queue, ids: list[str]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) until every request is finished; aborts the rest if stopped early.
        When the consumer fell behind (more outputs wait in the queue than the one it awaited),
        each request's waiting outputs come as one (_merged): one SSE chunk instead of one per step."""
        index = {rid: i for i, rid in enumerate(ids)}
        unfinished = set(ids)
        try:
            while unfinished:
                for rid, item in _merged([await queue.get()], queue):
                    if isinstance(item, BaseException):
                        unfinished.discard(rid)
                        if isinstance(item, ValueError):
                            raise bad_request(item)
                        if isinstance(item, ServerShuttingDown):
                            raise APIError(503, str(item), headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
                        if isinstance(item, EngineDead):
                            raise APIError(503, str(item))
                        raise APIError(500, f"request failed: {type(item).__name__}: {item}")
                    if item.finished:
                        unfinished.discard(rid)
                    yield index[rid], item
        finally:
            for rid in unfinished:
                self.async_engine.abort(rid)

    def _usage(self, prompts: list[Prompt], num_generated: int, finals) -> dict:
        """`finals`: each prompt's finished RequestOutput (their metrics say what the prefix cache served)."""
        num_prompt = sum(len(p.token_ids) for p in prompts)
        usage = {"prompt_tokens": num_prompt, "completion_tokens": num_generated,
                 "total_tokens": num_prompt + num_generated}
        if self.enable_prompt_tokens_details:
            cached = sum(max((m.num_cached_tokens for m in out.metrics), default=0) for out in finals)
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage


def _merged(items: list, queue: asyncio.Queue) -> list:
    """`items` plus everything already waiting in `queue` (taken without waiting), each
    request's consecutive DELTA outputs merged into one (outputs.merge_deltas), in the order the
    requests first appear; an error item keeps its place after the outputs that came before it."""
    while not queue.empty():
        items.append(queue.get_nowait())
    if len(items) == 1:
        return items
    merged: list = []
    pending: dict[str, RequestOutput] = {}
    for rid, item in items:
        if isinstance(item, BaseException):
            merged.extend(pending.items())
            pending.clear()
            merged.append((rid, item))
        elif rid in pending:
            pending[rid] = merge_deltas(pending[rid], item)
        else:
            pending[rid] = item
    merged.extend(pending.items())
    return merged
