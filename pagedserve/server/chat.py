"""/v1/chat/completions: the chat template, the tool plan, the response and its stream's
choices (plain content or tool calls)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from pagedserve.engine.output_processor import OutputKind
from pagedserve.sampling import SamplingParams
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from pagedserve.server.request_handling import Prompt
from pagedserve.structured.tool_parsers import get_tool_parser
from pagedserve.structured.tools import (NamedCallStream, RequiredCallStream, ToolCall, calls_from_required,
                                         tool_choice_constraint)


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass
class ChatPlan:
    """How a chat request's text becomes its answer: plain content, or tool calls."""

    prompt: Prompt
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


class Chat:
    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    continue_final_message: bool = False, kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> Prompt:
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
        return Prompt(text, self.tokenize_text(text, add_special_tokens=False))

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

    def prepare_chat(self, body: ChatCompletionRequest) -> ChatPlan:
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
        return ChatPlan(prompt, params, top_n, mode, name, parallel, echo_prefix)

    def _chat_message(self, plan: ChatPlan, comp) -> tuple[dict, str | None]:
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

    async def chat(self, body: ChatCompletionRequest, plan: ChatPlan, received: float | None = None) -> dict:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        queue, ids = self.submit(rid, [plan.prompt], plan.params, body.priority, OutputKind.FINAL_ONLY, received)
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

    def chat_stream(self, body: ChatCompletionRequest, rid: str, plan: ChatPlan, queue: asyncio.Queue,
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
