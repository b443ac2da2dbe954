"""Streaming: the SSE loop both endpoints share, the response that aborts its requests
however it ends, and the watch that cancels a non-streamed request whose client left."""
from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.outputs import RequestOutput
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import error_body
from pagedserve.server.request_handling import Prompt


class SSEStreams:
    async def _sse(self, rid: str, obj: str, stream_options, prompts: list[Prompt], n: int,
                   queue: asyncio.Queue, ids: list[str], make_choice, count_tokens: bool = True) -> AsyncIterator[str]:
        """The SSE loop both endpoints share: one chunk per step that produced tokens (even when
        their text is empty, as vLLM), or, when this stream fell behind the engine, one chunk for
        all the steps that queued up meanwhile (RequestHandling.results merges them: the socket
        write per chunk was most of the API process's time); a usage chunk on request, then
        [DONE]; an error ends the stream with an OpenAI error body. Outputs are deltas:
        `make_choice(index, comp, first, out)` builds one choice from what a sample gained
        (`first`: its first chunk; `out`: the RequestOutput, whose prompt_logprobs come with the
        first output)."""
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


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, coro):
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


class EngineStream(StreamingResponse):
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
