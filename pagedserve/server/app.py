"""The OpenAI-compatible HTTP app: completions, chat, models, tokenize, health, metrics.

Every check that can fail runs before anything is queued (API key and body size at the gate,
then model name, body shape, sampling values, prompt length, queue room), so a rejected
request changes no engine state. Tokenization and chat templates run on one worker thread,
never on the event loop. Errors use OpenAI's body: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedserve
from pagedserve.metrics import CONTENT_TYPE
from pagedserve.outputs import RequestOutput
from pagedserve.sampling import SamplingParams
from pagedserve.engine.async_llm import AsyncLLM, EngineDead, EngineOverloaded, ServerShuttingDown
from pagedserve.engine.output_processor import OutputKind
from pagedserve.server.gate import Gate
from pagedserve.server.protocol import (RETRY_AFTER_SECONDS, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                        DetokenizeRequest, ErrorResponse, NamedToolChoice, TokenizeRequest, error_body)
from pagedserve.server.request_trace import ArrivalStamp, RequestTrace, request_trace_path
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.structured.tool_parsers import get_tool_parser
from pagedserve.structured.tools import (NamedCallStream, RequiredCallStream, ToolCall, calls_from_required,
                                         tool_choice_constraint)

logger = logging.getLogger("pagedserve.server")

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf
_ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}
# Bytes of request body allowed per token of max_model_len (JSON escapes and chat markup
# included), and the least any server allows.
_BODY_BYTES_PER_TOKEN = 32
_MIN_BODY_BYTES = 1 << 20


def default_max_request_bytes(max_model_len: int) -> int:
    return max(_MIN_BODY_BYTES, _BODY_BYTES_PER_TOKEN * max_model_len)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    @property
    def type(self) -> str:
        return {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestTooLargeError", 503: "ServiceUnavailableError"}.get(self.status, "InternalServerError")


def bad_request(e: Exception | str) -> APIError:
    """A ValueError 'field: message' becomes a 400 naming the field."""
    message = str(e)
    head = message.split(":", 1)[0]
    is_field = all(c.isalnum() or c in "_.[]" for c in head) and head != message
    return APIError(400, message, head if is_field else None)


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


def _num_prompts(prompt) -> int:
    """How many prompts a completions `prompt` holds (a string or a token-id list is one),
    counted without tokenizing; malformed forms count 1 and are refused by completion_prompts."""
    if isinstance(prompt, str) or not isinstance(prompt, list) or not prompt:
        return 1
    return 1 if all(isinstance(x, int) for x in prompt) else len(prompt)


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass
class _ChatPlan:
    """How a chat request's text becomes its answer: plain content, or tool calls."""

    prompt: _Prompt
    params: SamplingParams
    top_n: int
    tool_mode: str = "none"           # "none" | "named" | "required" | "auto"
    tool_name: str | None = None      # named
    parallel_tool_calls: bool = True
    echo_prefix: str = ""             # chat echo: the last message's content, when it is the answer's role

    def stream(self, parser_name: str | None):
        if self.tool_mode == "named":
            return NamedCallStream(self.tool_name)
        if self.tool_mode == "required":
            return RequiredCallStream()
        if self.tool_mode == "auto":
            return get_tool_parser(parser_name).stream()
        return None


class OpenAIServer:
    """Request handling, independent of the routes: easier to read and to test."""

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
            self.request_trace.arrived(rid, getattr(request.state, "t_http", None))

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

    def validate(self, prompts: list[_Prompt], params: SamplingParams) -> None:
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

    def completion_prompts(self, prompt) -> list[_Prompt]:
        if isinstance(prompt, str):
            return [_Prompt(prompt, self.tokenize_text(prompt))]
        if not prompt:
            raise APIError(400, "prompt: must not be empty", "prompt")
        if all(isinstance(x, int) for x in prompt):
            return [_Prompt(None, list(prompt))]
        if all(isinstance(x, str) for x in prompt):
            return [_Prompt(x, self.tokenize_text(x)) for x in prompt]
        return [_Prompt(None, list(x)) for x in prompt]

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    continue_final_message: bool = False, kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> _Prompt:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "messages: this model has no chat template; use /v1/completions with a prompt",
                           "messages")
        if not messages:
            raise APIError(400, "messages: must hold at least one message", "messages")
        conversation = []
        for m in messages:
            if isinstance(m.content, list):
                if any(part.type != "text" for part in m.content):
                    raise APIError(400, "messages: only text content parts are supported", "messages")
                content = "".join(part.text or "" for part in m.content)
            else:
                content = m.content or ""
            turn = {"role": m.role, "content": content}
            if m.name is not None:
                turn["name"] = m.name
            if m.tool_calls:
                # As the templates that render calls expect: arguments parsed when they are JSON.
                turn["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                    "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id is not None:
                turn["tool_call_id"] = m.tool_call_id
            conversation.append(turn)
        reserved = {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                    "return_dict", "return_tensors", "chat_template", "tools", "documents", "tokenizer_kwargs",
                    "padding", "truncation", "max_length", "return_assistant_tokens_mask"}
        extra = {k: v for k, v in (kwargs or {}).items() if k not in reserved}
        try:
            if tools:
                extra["tools"] = tools
            text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, **extra)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None
        if not isinstance(text, str):
            raise APIError(400, "messages: the chat template did not produce text", "messages")
        return _Prompt(text, self.tokenize_text(text, add_special_tokens=False))

    # -- running requests ------------------------------------------------------------
    def submit(self, base_id: str, prompts: list[_Prompt], params: SamplingParams, priority: int,
               kind: OutputKind) -> tuple[asyncio.Queue, list[str]]:
        ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        try:
            queue = self.async_engine.submit([(rid, p.text, p.token_ids) for rid, p in zip(ids, prompts)], params,
                                             priority, kind)
        except (EngineOverloaded, ServerShuttingDown) as e:
            raise APIError(503, str(e), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except EngineDead as e:
            raise APIError(503, str(e)) from None
        return queue, ids

    async def results(self, queue: asyncio.Queue, ids: list[str]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) until every request is finished; aborts the rest if stopped early."""
        index = {rid: i for i, rid in enumerate(ids)}
        unfinished = set(ids)
        try:
            while unfinished:
                rid, item = await queue.get()
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

    # -- logprobs --------------------------------------------------------------------
    def _token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    @staticmethod
    def _lp(value: float) -> float:
        return value if math.isfinite(value) else _LOGPROB_FLOOR

    def completion_logprobs(self, logprobs: list, offset: int) -> dict:
        """OpenAI's completions logprobs object; an entry of None (the first prompt token,
        which nothing predicts) has null token_logprobs and top_logprobs."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in logprobs:
            text = self._token_text(lp.token_id)
            tokens.append(text)
            token_lps.append(self._lp(lp.logprob))
            top = {text: self._lp(lp.logprob)}
            for tid, v in lp.top:
                top.setdefault(self._token_text(tid), self._lp(v))
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def echo_logprobs(self, prompt: _Prompt, prompt_logprobs: list) -> dict:
        """The prompt's part of an echo's logprobs: its first token has null logprobs."""
        first_text = self._token_text(prompt.token_ids[0])
        rest = self.completion_logprobs(prompt_logprobs[1:], len(first_text))
        return {"tokens": [first_text] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}

    def prompt_logprobs_json(self, prompt_logprobs: list | None) -> list | None:
        """vLLM's `prompt_logprobs`: null for the first prompt token (nothing predicts it), then
        per token {token id (a string): {"logprob", "rank", "decoded_token"}} for the prompt's own
        token (its rank in the vocabulary) and the top k (ranks 1..k)."""
        if prompt_logprobs is None:
            return None
        out: list[dict | None] = []
        for lp in prompt_logprobs:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": self._lp(lp.logprob), "rank": lp.rank,
                                        "decoded_token": self._token_text(lp.token_id)}}
            for rank, (tid, value) in enumerate(lp.top, 1):
                entry.setdefault(str(tid), {"logprob": self._lp(value), "rank": rank,
                                            "decoded_token": self._token_text(tid)})
            out.append(entry)
        return out

    @staticmethod
    def join_logprobs(*parts: dict | None) -> dict | None:
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        return {key: [v for p in parts for v in p[key]] for key in parts[0]}

    def chat_logprobs(self, logprobs: list, top_n: int) -> dict:
        content = []
        for lp in logprobs:
            text = self._token_text(lp.token_id)
            content.append({
                "token": text, "logprob": self._lp(lp.logprob), "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self._token_text(tid)), "logprob": self._lp(v),
                                  "bytes": list(t.encode())} for tid, v in lp.top[:top_n]],
            })
        return {"content": content}

    # -- /v1/completions -------------------------------------------------------------
    def prepare_completion(self, body: CompletionRequest):
        self.check_model(body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of: only best_of == n is supported", "best_of")
        if body.suffix:
            raise APIError(400, "suffix: not supported", "suffix")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens: 0 is only allowed with echo=true (score the prompt, generate nothing)",
                           "max_tokens")
        # echo + logprobs: the prompt tokens' logprobs come first (OpenAI's legacy scoring).
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        # max_tokens=0 runs one step and drops its token: the engine always samples at the prompt's end.
        max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
        params = self.sampling_params(body, max_tokens, body.logprobs, self.structured_constraint(body),
                                      prompt_logprobs)
        self.check_num_seqs(_num_prompts(body.prompt), params.n)
        prompts = self.completion_prompts(body.prompt)
        self.validate(prompts, params)
        return prompts, params

    def _echo(self, body, prompt: _Prompt) -> str:
        if not body.echo:
            return ""
        return prompt.text if prompt.text is not None else self.decode(prompt.token_ids)

    def _completion_choice(self, body, prompt: _Prompt, comp, prompt_logprobs, first: bool, offset: int) -> dict:
        """One completion choice (or its delta). `offset`: where its logprobs' text_offset goes on,
        the length of the tokens already sent in this choice's logprobs (0 for the first).
        text_offset is one running offset over the choice's tokens, echoed prompt included: each
        token's offset is the length of the tokens before it joined (as vLLM counts it)."""
        prefix = self._echo(body, prompt) if first else ""
        text, logprobs = comp.text, comp.logprobs
        if body.max_tokens == 0:  # generated nothing: the one step's token is not part of the answer
            text, logprobs = "", ([] if logprobs is not None else None)
        lp = None
        if logprobs is not None:
            echoed = self.echo_logprobs(prompt, prompt_logprobs) if first and prompt_logprobs is not None else None
            lp = self.join_logprobs(echoed, self.completion_logprobs(logprobs, self._logprobs_end(echoed, offset)))
        return {"text": prefix + text, "logprobs": lp, "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason}

    @staticmethod
    def _logprobs_end(lp: dict | None, offset: int) -> int:
        """The text_offset that follows a logprobs object's last token (`offset` if it has none)."""
        if not lp or not lp["tokens"]:
            return offset
        return lp["text_offset"][-1] + len(lp["tokens"][-1])

    async def completion(self, body: CompletionRequest, prompts: list[_Prompt], params: SamplingParams) -> dict:
        rid = f"cmpl-{uuid.uuid4().hex}"
        queue, ids = self.submit(rid, prompts, params, body.priority, OutputKind.FINAL_ONLY)
        final: dict[int, RequestOutput] = {}
        async for i, out in self.results(queue, ids):
            final[i] = out
        choices = []
        num_generated = 0
        for i, prompt in enumerate(prompts):
            scored = self.prompt_logprobs_json(final[i].prompt_logprobs)
            for comp in final[i].outputs:
                num_generated += 0 if body.max_tokens == 0 else len(comp.token_ids)
                choice = self._completion_choice(body, prompt, comp, final[i].prompt_logprobs, True, 0)
                choices.append({"index": i * params.n + comp.index, **choice})
                if scored is not None:  # as vLLM: on each choice of the prompt
                    choices[-1]["prompt_logprobs"] = scored
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": self._usage(prompts, num_generated, final.values())}

    def _usage(self, prompts: list[_Prompt], num_generated: int, finals) -> dict:
        """`finals`: each prompt's finished RequestOutput (their metrics say what the prefix cache served)."""
        num_prompt = sum(len(p.token_ids) for p in prompts)
        usage = {"prompt_tokens": num_prompt, "completion_tokens": num_generated,
                 "total_tokens": num_prompt + num_generated}
        if self.enable_prompt_tokens_details:
            cached = sum(max((m.num_cached_tokens for m in out.metrics), default=0) for out in finals)
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    async def _sse(self, rid: str, obj: str, stream_options, prompts: list[_Prompt], n: int,
                   queue: asyncio.Queue, ids: list[str], make_choice, count_tokens: bool = True) -> AsyncIterator[str]:
        """The SSE loop both endpoints share: one chunk per step that produced tokens (even when
        their text is empty, as vLLM), a usage chunk on request, then [DONE]; an error ends the
        stream with an OpenAI error body. Outputs are deltas: `make_choice(index, comp, first,
        out)` builds one choice from what a sample gained (`first`: its first chunk; `out`: the
        RequestOutput, whose prompt_logprobs come with the first output)."""
        created = int(time.time())
        started: set[int] = set()
        num_generated = 0
        finals: dict[int, RequestOutput] = {}
        include_usage = bool(stream_options and stream_options.include_usage)
        continuous = include_usage and bool(stream_options.continuous_usage_stats)
        trace = self.request_trace
        first_out: dict[int, float] = {}
        last_out: dict[int, float] = {}
        chunks: dict[int, int] = {}
        tokens: dict[int, int] = {}

        def chunk(choices: list[dict], usage=None) -> str:
            payload = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        try:
            async for i, out in self.results(queue, ids):
                if out.finished:
                    finals[i] = out
                choices = []
                new_tokens = 0
                for comp in out.outputs:
                    index = i * n + comp.index
                    choices.append(make_choice(index, comp, index not in started, out))
                    started.add(index)
                    new_tokens += len(comp.token_ids)
                num_generated += new_tokens if count_tokens else 0
                if choices:
                    if trace is not None and new_tokens:
                        now = time.monotonic()
                        first_out.setdefault(i, now)
                        last_out[i] = now
                        chunks[i] = chunks.get(i, 0) + 1
                        tokens[i] = tokens.get(i, 0) + new_tokens
                    yield chunk(choices, self._usage(prompts, num_generated, finals.values()) if continuous else None)
            if include_usage:
                yield chunk([], self._usage(prompts, num_generated, finals.values()))
            yield "data: [DONE]\n\n"
            if trace is not None:
                trace.streamed(rid, [len(p.token_ids) for p in prompts], finals, first_out, last_out, chunks, tokens)
        except APIError as e:
            yield f"data: {json.dumps(error_body(e.status, e.message, e.type, e.param))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if trace is not None:
                trace.forget(rid)

    def completion_stream(self, body: CompletionRequest, rid: str, prompts: list[_Prompt], params: SamplingParams,
                          queue: asyncio.Queue, ids: list[str]) -> AsyncIterator[str]:
        lp_offset: dict[int, int] = {}  # choice index -> the text_offset its next token gets
        scored: dict[int, list] = {}  # prompt index -> its prompt logprobs (they come with its first output)

        def make_choice(index, comp, first, out):
            offset = lp_offset.get(index, 0)
            if out.prompt_logprobs is not None:
                scored[index // params.n] = out.prompt_logprobs
            choice = self._completion_choice(body, prompts[index // params.n], comp, scored.get(index // params.n),
                                             first, offset)
            lp_offset[index] = self._logprobs_end(choice["logprobs"], offset)
            return {"index": index, **choice}

        return self._sse(rid, "text_completion", body.stream_options, prompts, params.n, queue, ids, make_choice,
                         count_tokens=body.max_tokens != 0)

    # -- /v1/chat/completions --------------------------------------------------------
    def tool_plan(self, body: ChatCompletionRequest) -> tuple[str, str | None, list[dict] | None]:
        """(tool mode, named function, tools for the template) after checking tools and tool_choice."""
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        choice = body.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise APIError(400, "tools: function names must be unique", "tools")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice")
            return "named", choice.function.name, tools
        if choice in ("required", "auto") and not tools:
            raise APIError(400, f"tool_choice: {choice!r} needs tools", "tool_choice")
        if choice == "auto" and not (self.enable_auto_tool_choice and self.tool_call_parser):
            raise APIError(400, 'tool_choice: "auto" needs the server started with --enable-auto-tool-choice and '
                                '--tool-call-parser; or send tool_choice "required", "none" or a named function',
                           "tool_choice")
        if choice == "auto":
            for i, t in enumerate(tools):
                if t["function"].get("strict"):
                    raise APIError(400, f"tools[{i}].function.strict: arguments are held to the schema only under "
                                        'tool_choice "required" or a named function, not "auto"',
                                   f"tools[{i}].function.strict")
        if choice == "none":
            return "none", None, None  # as vLLM: the tools are not shown to a model that may not call them
        return choice, None, tools

    def prepare_chat(self, body: ChatCompletionRequest) -> _ChatPlan:
        self.check_model(body.model)
        top_n = 0
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
            top_n = body.top_logprobs
        logprobs = top_n if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        mode, name, tools = self.tool_plan(body)
        parallel = body.parallel_tool_calls is not False
        tool_constraint = None
        if mode in ("named", "required"):
            tool_constraint = tool_choice_constraint(tools, {"function": {"name": name}} if name else mode, parallel)
        params = self.sampling_params(body, max_tokens, logprobs, self.structured_constraint(body, tool_constraint))
        self.check_num_seqs(1, params.n)
        prompt = self.chat_prompt(body.messages, body.add_generation_prompt, body.continue_final_message,
                                  body.chat_template_kwargs, tools)
        self.validate([prompt], params)
        echo_prefix = ""
        if body.echo and body.messages:
            # vLLM's chat echo: the answer starts with the last message when it has the answer's role.
            role = "assistant" if body.add_generation_prompt else body.messages[-1].role
            last = body.messages[-1]
            if last.role == role and isinstance(last.content, str):
                echo_prefix = last.content
        return _ChatPlan(prompt, params, top_n, mode, name, parallel, echo_prefix)

    def _chat_message(self, plan: _ChatPlan, comp) -> tuple[dict, str | None]:
        """(message, finish_reason) of one finished choice."""
        text = plan.echo_prefix + comp.text
        finish = comp.finish_reason
        calls: list[ToolCall] = []
        content: str | None = text
        if plan.tool_mode == "named":
            calls, content = [ToolCall(plan.tool_name, comp.text)], None
        elif plan.tool_mode == "required":
            # A text cut off by max_tokens gives the calls begun in it (finish_reason "length"),
            # as its stream does; a call whose name was not yet written is not one.
            calls, content = calls_from_required(comp.text), None
        elif plan.tool_mode == "auto":
            content, calls = get_tool_parser(self.tool_call_parser).extract(comp.text)
            if not plan.parallel_tool_calls:
                calls = calls[:1]
        if calls and plan.tool_mode != "named" and finish == "stop":
            finish = "tool_calls"
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return message, finish

    async def chat(self, body: ChatCompletionRequest, plan: _ChatPlan) -> dict:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        queue, ids = self.submit(rid, [plan.prompt], plan.params, body.priority, OutputKind.FINAL_ONLY)
        final = None
        async for _, out in self.results(queue, ids):
            final = out
        choices = []
        for comp in final.outputs:
            message, finish = self._chat_message(plan, comp)
            choices.append({
                "index": comp.index, "message": message,
                "logprobs": self.chat_logprobs(comp.logprobs, plan.top_n) if comp.logprobs is not None else None,
                "finish_reason": finish, "stop_reason": comp.stop_reason,
            })
        num_generated = sum(len(c.token_ids) for c in final.outputs)
        response = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                    "choices": choices, "usage": self._usage([plan.prompt], num_generated, [final])}
        if final.prompt_logprobs is not None:  # as vLLM: once, at the top level
            response["prompt_logprobs"] = self.prompt_logprobs_json(final.prompt_logprobs)
        return response

    def chat_stream(self, body: ChatCompletionRequest, rid: str, plan: _ChatPlan, queue: asyncio.Queue,
                    ids: list[str]) -> AsyncIterator[str]:
        streams: dict[int, object] = {}

        def make_choice(index, comp, first, out):
            stream = streams.get(index)
            if stream is None and plan.tool_mode != "none":
                stream = streams[index] = plan.stream(self.tool_call_parser)
            text = (plan.echo_prefix if first and plan.tool_mode == "none" else "") + comp.text
            content, calls = (text, []) if stream is None else stream.feed(comp.text)
            finish = comp.finish_reason
            if finish is not None and stream is not None:
                rest, more = stream.finish()
                content, calls = content + rest, calls + more
                if stream.called and plan.tool_mode != "named" and finish == "stop":
                    finish = "tool_calls"
            if calls and plan.tool_mode == "auto" and not plan.parallel_tool_calls:
                calls = [c for c in calls if c["index"] == 0]
            # The role comes with the first generated token, as vLLM sends it: a client timing
            # its first chunk then measures the real time to first token.
            delta: dict = {"role": "assistant"} if first else {}
            if content or (first and not calls) or (comp.token_ids and stream is None):
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            return {"index": index, "delta": delta,
                    "logprobs": self.chat_logprobs(comp.logprobs, plan.top_n) if comp.logprobs is not None else None,
                    "finish_reason": finish, "stop_reason": comp.stop_reason}

        return self._sse(rid, "chat.completion.chunk", body.stream_options, [plan.prompt], plan.params.n, queue, ids,
                         make_choice)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro):
    """Run coro; if the client goes away first, cancel it (its finally aborts the engine requests)."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    try:
        await work
    except (asyncio.CancelledError, Exception):  # noqa: BLE001
        pass
    return Response(status_code=499)


class _EngineStream(StreamingResponse):
    """SSE response that aborts its engine requests however it ends (also if the client leaves
    before the first chunk, when the body generator never ran its own finally)."""

    def __init__(self, gen: AsyncIterator[str], async_engine: AsyncLLM, ids: list[str]) -> None:
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._async_engine = async_engine
        self._ids = ids

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for rid in self._ids:  # a no-op for requests that finished
                self._async_engine.abort(rid)


def build_app(async_engine: AsyncLLM, api_key: str | None = None, manage_engine: bool = True,
              max_request_bytes: int | None = None, enable_prompt_tokens_details: bool = False,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              dashboard: bool = True, max_seqs_per_request: int | None = None,
              shutdown_timeout: float | None = None) -> FastAPI:
    """The FastAPI app. With manage_engine the engine thread starts and stops with the app.
    `max_request_bytes`: None = default_max_request_bytes(max_model_len); 0 = no limit.
    `max_seqs_per_request`: None = no limit (build_server passes its default).
    `dashboard`: serve /dashboard (server/dashboard.py). `shutdown_timeout`: how long a
    shutdown signal lets the requests in flight finish (server/drain.py; None = its default)."""
    from pagedserve.server.drain import DEFAULT_SHUTDOWN_TIMEOUT, Drain, DrainGate

    drain = Drain(async_engine, DEFAULT_SHUTDOWN_TIMEOUT if shutdown_timeout is None else shutdown_timeout)
    server = OpenAIServer(async_engine, enable_prompt_tokens_details, enable_auto_tool_choice, tool_call_parser,
                          max_seqs_per_request)
    metrics = async_engine.metrics
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(async_engine.engine.config.max_model_len)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            async_engine.start()
        try:
            yield
        finally:
            if manage_engine:
                async_engine.shutdown()
            if server.request_trace is not None:
                server.request_trace.close()

    app = FastAPI(title="pagedserve", version=pagedserve.__version__, lifespan=lifespan)
    app.state.server = server
    app.state.async_engine = async_engine
    app.state.drain = drain
    app.add_middleware(Gate, api_key=api_key, max_request_bytes=max_request_bytes or None)
    app.add_middleware(DrainGate, drain=drain)  # outside the gate: it counts a request from its arrival
    if server.request_trace is not None:
        app.add_middleware(ArrivalStamp)  # added last = outermost: the stamp precedes the gate

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        # FastAPI's own refusals (a body that is not UTF-8, an unknown route, a wrong method)
        # in OpenAI's error shape too.
        status = e.status_code
        param = "body" if status == 400 else None
        message = f"body: {e.detail}" if status == 400 else str(e.detail)
        return JSONResponse(error_body(status, message, APIError(status, "").type, param), status_code=status,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(error_body(e.status, e.message, e.type, e.param), status_code=e.status,
                            headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or "body"
        if first.get("type") == "json_invalid":
            message = f"body: malformed JSON ({first.get('msg', 'invalid')})"
            param = "body"
        elif first.get("type") == "value_error" and ":" in str(first.get("ctx", {}).get("error", "")):
            message = str(first["ctx"]["error"])  # our own validator's "field: reason"
            param = message.split(":", 1)[0]
        else:
            message = f"{param}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(400, message, "BadRequestError", param), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        logger.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}", "InternalServerError",
                                       None), status_code=500)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if drain.draining:
            return JSONResponse(error_body(503, drain.message(), "ServiceUnavailableError", None), status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        if not async_engine.is_running:
            reason = async_engine.death_reason()
            message = f"engine is not running: {reason}" if reason else "engine is not running"
            return JSONResponse(error_body(503, message, "ServiceUnavailableError", None), status_code=503)
        stall = async_engine.check_stall()
        if stall is not None:  # alive but not stepping (engine/async_llm.py: the step watchdog)
            body = error_body(503, stall.message(), "ServiceUnavailableError", None)
            body["error"].update(stall.to_dict())
            return JSONResponse(body, status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": pagedserve.__version__}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus_metrics():
        if metrics is None:
            return Response(b"", media_type=CONTENT_TYPE)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=_ERROR_RESPONSES)
    async def models():
        engine = server.engine
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "pagedserve",
            "root": str(engine.config.model), "parent": None, "max_model_len": engine.config.max_model_len,
        }]}

    @app.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        prompts, params = await server.off_loop(server.prepare_completion, body)
        if body.stream:
            rid = f"cmpl-{uuid.uuid4().hex}"
            server.trace_arrival(rid, request)
            queue, ids = server.submit(rid, prompts, params, body.priority, OutputKind.DELTA)
            return _EngineStream(server.completion_stream(body, rid, prompts, params, queue, ids), async_engine, ids)
        return await _unless_disconnected(request, server.completion(body, prompts, params))

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        plan = await server.off_loop(server.prepare_chat, body)
        if body.stream:
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            server.trace_arrival(rid, request)
            queue, ids = server.submit(rid, [plan.prompt], plan.params, body.priority, OutputKind.DELTA)
            return _EngineStream(server.chat_stream(body, rid, plan, queue, ids), async_engine, ids)
        return await _unless_disconnected(request, server.chat(body, plan))

    @app.post("/tokenize", responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt or messages", "prompt")
        if body.prompt is not None:
            tokens = await server.off_loop(server.tokenize_text, body.prompt, body.add_special_tokens)
        else:
            prompt = await server.off_loop(server.chat_prompt, body.messages, body.add_generation_prompt)
            tokens = prompt.token_ids
        return {"count": len(tokens), "max_model_len": server.engine.config.max_model_len, "tokens": tokens}

    @app.post("/detokenize", responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        vocab = server.engine.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise APIError(400, f"tokens: token ids must be in [0, {vocab})", "tokens")
        if server.engine.tokenizer is None:
            raise APIError(400, "tokens: this model has no tokenizer", "tokens")
        return {"prompt": await server.off_loop(server.decode, body.tokens)}

    if dashboard:
        from pagedserve.server.dashboard import mount_dashboard
        mount_dashboard(app, async_engine)
    return app
