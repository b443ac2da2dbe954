"""The OpenAI-compatible HTTP app: completions, chat, models, tokenize, health, metrics.

Every check that can fail runs before anything is queued (API key and body size at the gate,
then model name, body shape, sampling values, prompt length, queue room), so a rejected
request changes no engine state. Tokenization and chat templates run on one worker thread,
never on the event loop. Errors use OpenAI's body: {"error": {"message", "type", "param", "code"}}.

    app.py               the routes and the app (middleware, lifespan, dashboard)
    request_handling.py  checks, SamplingParams, prompts, submit / results
    completions.py       /v1/completions          chat.py      /v1/chat/completions, tools
    logprobs.py          the logprob formats      sse.py       the SSE loop, disconnects
    errors.py            APIError and the error handlers
"""
from __future__ import annotations

import logging
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import pagedserve
from pagedserve.metrics import CONTENT_TYPE
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.output_processor import OutputKind
from pagedserve.server.chat import Chat
from pagedserve.server.completions import Completions
from pagedserve.server.errors import ERROR_RESPONSES, APIError, install_error_handlers
from pagedserve.server.gate import Gate
from pagedserve.server.logprobs import LogprobFormats
from pagedserve.server.protocol import (RETRY_AFTER_SECONDS, ChatCompletionRequest, CompletionRequest,
                                        DetokenizeRequest, TokenizeRequest, error_body)
from pagedserve.server.request_handling import RequestHandling
from pagedserve.server.request_trace import ArrivalStamp, received
from pagedserve.server.sse import EngineStream, SSEStreams, unless_disconnected

logger = logging.getLogger("pagedserve.server")

# Bytes of request body allowed per token of max_model_len (JSON escapes and chat markup
# included), and the least any server allows.
_BODY_BYTES_PER_TOKEN = 32
_MIN_BODY_BYTES = 1 << 20


def default_max_request_bytes(max_model_len: int) -> int:
    return max(_MIN_BODY_BYTES, _BODY_BYTES_PER_TOKEN * max_model_len)


class OpenAIServer(Completions, Chat, SSEStreams, LogprobFormats, RequestHandling):
    """Request handling, independent of the routes: easier to read and to test. One object,
    its parts in the files above (each endpoint's own, and what they share)."""


def build_app(async_engine: AsyncLLM, api_key: str | None = None, manage_engine: bool = True,
              max_request_bytes: int | None = None, enable_prompt_tokens_details: bool = False,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              dashboard: bool = True, max_seqs_per_request: int | None = None,
              shutdown_timeout: float | None = None) -> FastAPI:
    """The FastAPI app. With manage_engine the engine thread starts and stops with the app.
    `max_request_bytes`: None = default_max_request_bytes(max_model_len); 0 = no limit.
    `max_seqs_per_request`: None = no limit (build_server passes its default).
    `dashboard`: serve /dashboard (dashboard/routes.py). `shutdown_timeout`: how long a
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
    # Added last = outermost: the stamp precedes the gate, the body parser and tokenizing, and it is the
    # arrival TTFT, E2E latency and queue time count from (what the client waits, not just the engine).
    app.add_middleware(ArrivalStamp)
    install_error_handlers(app)

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

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models():
        engine = server.engine
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "pagedserve",
            "root": str(engine.config.model), "parent": None, "max_model_len": engine.config.max_model_len,
        }]}

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        prompts, params = await server.off_loop(server.prepare_completion, body)
        if body.stream:
            rid = f"cmpl-{uuid.uuid4().hex}"
            server.trace_arrival(rid, request)
            queue, ids = server.submit(rid, prompts, params, body.priority, OutputKind.DELTA, received(request))
            return EngineStream(server.completion_stream(body, rid, prompts, params, queue, ids), async_engine, ids)
        return await unless_disconnected(request, server.completion(body, prompts, params, received(request)))

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        plan = await server.off_loop(server.prepare_chat, body)
        if body.stream:
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            server.trace_arrival(rid, request)
            queue, ids = server.submit(rid, [plan.prompt], plan.params, body.priority, OutputKind.DELTA,
                                       received(request))
            return EngineStream(server.chat_stream(body, rid, plan, queue, ids), async_engine, ids)
        return await unless_disconnected(request, server.chat(body, plan, received(request)))

    @app.post("/tokenize", responses=ERROR_RESPONSES)
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

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        vocab = server.engine.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise APIError(400, f"tokens: token ids must be in [0, {vocab})", "tokens")
        if server.engine.tokenizer is None:
            raise APIError(400, "tokens: this model has no tokenizer", "tokens")
        return {"prompt": await server.off_loop(server.decode, body.tokens)}

    if dashboard:
        from pagedserve.dashboard.routes import mount_dashboard
        mount_dashboard(app, async_engine)
    return app
