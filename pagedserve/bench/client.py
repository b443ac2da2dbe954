"""The load generator's client: stream one request, time every token as it arrives; run a workload.

Everything is measured from the stream the client reads, never taken from the server's own
numbers (which a peer may not expose): TTFT is the first chunk that carries a token, the gap
before every later one is an inter-token latency (ITL), E2E is the end of the stream. Output tokens come from the server's `usage` (asked
for with `stream_options.include_usage`) when it sends one, else one per content chunk.

Works against any OpenAI-compatible server: pagedserve, vLLM, llama.cpp's server.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator, Callable

import aiohttp

from pagedserve.bench.workloads import WorkloadRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

# A plain word list for chat prompts given as token ids when no tokenizer is at hand.
_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
          "point number group problem fact water room mother area money story month lot right study book "
          "job word business issue side kind head house service friend father power hour game line end "
          "member law car city name team minute idea kid body information back parent face others level").split()


@dataclass
class RequestResult:
    """What the client saw of one request. Times are seconds; `start` is relative to the run's start."""

    index: int
    success: bool = False
    error: str = ""
    prompt_len: int = 0            # from the workload, or the server's usage.prompt_tokens when sent
    output_tokens: int = 0         # usage.completion_tokens when sent, else the number of content chunks
    output_tokens_from_usage: bool = False
    num_chunks: int = 0            # token-carrying chunks received
    start: float = 0.0             # when the request was sent
    ttft: float = 0.0              # first token chunk - start
    itl: list[float] = field(default_factory=list)  # gap before each later token chunk
    e2el: float = 0.0              # end of stream - start
    scheduled: float = 0.0         # when the workload said it should arrive
    generated_text: str = ""
    tags: dict = field(default_factory=dict)

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output_tokens - 1): the mean time per output token after the first."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def end(self) -> float:
        return self.start + self.e2el

    def token_times(self) -> list[float]:
        """When each token chunk arrived, relative to the run's start."""
        if not self.success or self.num_chunks == 0:
            return []
        t = self.start + self.ttft
        times = [t]
        for gap in self.itl:
            t += gap
            times.append(t)
        return times

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


@dataclass
class BenchTarget:
    base_url: str
    model: str
    endpoint: str = "completions"   # completions | chat
    api_key: str | None = None
    temperature: float = 0.0
    timeout_s: float = 6 * 3600
    extra_body: dict = field(default_factory=dict)  # merged into every request (server-specific knobs)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]


def words_prompt(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def request_body(target: BenchTarget, req: WorkloadRequest, index: int, tokenizer=None) -> dict:
    """The JSON body for one workload request (token-id prompts stay token ids on /v1/completions)."""
    body: dict = {"model": target.model, "max_tokens": req.output_len, "temperature": target.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if req.ignore_eos:
        body["ignore_eos"] = True  # vLLM, pagedserve and llama.cpp all read this extra field
    if target.endpoint == "completions":
        body["prompt"] = req.prompt if req.prompt is not None else list(req.prompt_token_ids)
    else:
        if req.prompt is not None:
            text = req.prompt
        elif tokenizer is not None:
            text = tokenizer.decode(req.prompt_token_ids)
        else:
            text = words_prompt(req.prompt_len, index)
        body["messages"] = [{"role": "user", "content": text}]
    body.update(target.extra_body)
    return body


async def sse_payloads(lines: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent-event stream, one per event, '[DONE]' included."""
    async for raw in lines:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line or line.startswith(":"):
            continue
        if line.startswith("data:"):
            yield line[5:].strip()


def _chunk_event(payload: dict, endpoint: str) -> tuple[bool, str]:
    """(is this chunk a token arrival, the text it carries).

    As vLLM's own benchmark counts, a chunk that carries a choice is an arrival even with empty
    text (a random-weight model's tokens often decode to nothing, and vLLM still streams one
    chunk per token). Not arrivals: chat's leading role-only chunk, and a closing chunk with no
    text and a finish_reason (llama.cpp sends one after the last token; it carries no token)."""
    choices = payload.get("choices") or []
    if not choices:
        return False, ""
    choice = choices[0]
    if endpoint == "completions":
        text = choice.get("text") or ""
        role_only = False
    else:
        delta = choice.get("delta") or {}
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        role_only = "role" in delta
    finish_only = choice.get("finish_reason") is not None
    return bool(text) or not (role_only or finish_only), text


async def consume_stream(lines: AsyncIterator[bytes], result: RequestResult, endpoint: str, start_clock: float,
                         clock: Callable[[], float] = time.perf_counter) -> RequestResult:
    """Fill `result` from an SSE stream; `start_clock` is clock() when the request was sent.

    Separate from the HTTP call so the timing rules can be tested on a scripted stream and clock."""
    last = None
    texts = []
    usage = None
    async for data in sse_payloads(lines):
        now = clock()
        if data == "[DONE]":
            break
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            result.error = f"bad SSE payload: {data[:200]}"
            return result
        if payload.get("error"):
            err = payload["error"]
            result.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return result
        if payload.get("usage"):
            usage = payload["usage"]
        arrival, text = _chunk_event(payload, endpoint)
        if not arrival:
            continue
        if last is None:
            result.ttft = now - start_clock
        else:
            result.itl.append(now - last)
        last = now
        result.num_chunks += 1
        texts.append(text)
    end = clock()
    if last is None:
        result.error = "the stream ended without any completion chunk"
        return result
    result.e2el = end - start_clock
    result.generated_text = "".join(texts)
    if usage and usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.output_tokens_from_usage = True
        if usage.get("prompt_tokens"):
            result.prompt_len = int(usage["prompt_tokens"])
    else:
        result.output_tokens = result.num_chunks
    result.success = True
    return result


async def send_request(session: aiohttp.ClientSession, target: BenchTarget, body: dict, result: RequestResult,
                       run_start: float) -> RequestResult:
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    start = time.perf_counter()
    result.start = start - run_start
    try:
        async with session.post(target.url, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = await resp.text()
                result.error = f"HTTP {resp.status}: {text[:300]}"
                result.e2el = time.perf_counter() - start
                return result
            await consume_stream(resp.content, result, target.endpoint, start)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        result.e2el = time.perf_counter() - start
    return result


@dataclass
class LoadRun:
    results: list[RequestResult]
    duration: float      # first send to last byte, seconds
    started_at: float    # time.time() at the start (for logs)
    # time.monotonic() at the start: a result's `start` + this is its send time on the clock
    # a server on this machine stamps its request trace with (`simulate calibrate --bench-result`).
    start_monotonic: float = 0.0


async def run_load(target: BenchTarget, workload: list[WorkloadRequest], *, max_concurrency: int | None = None,
                   tokenizer=None, progress: bool = True, on_start: Callable[[float], None] | None = None) -> LoadRun:
    """Send every request at its arrival time (at most `max_concurrency` in flight); wait for all.

    `on_start(run_start_perf_counter)` is called just before the first request goes out."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1, got {max_concurrency}")
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bodies = [request_body(target, req, i, tokenizer) for i, req in enumerate(workload)]
    results = [RequestResult(index=i, prompt_len=req.prompt_len, tags=dict(req.tags))
               for i, req in enumerate(workload)]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(workload), desc="requests", unit="req")

    timeout = aiohttp.ClientTimeout(total=target.timeout_s)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=False,
                                     read_bufsize=2**20) as session:
        run_start = time.perf_counter()
        started_at = time.time()
        start_monotonic = time.monotonic() - (time.perf_counter() - run_start)
        if on_start is not None:
            on_start(run_start)

        async def one(i: int) -> None:
            delay = workload[i].arrival_time - (time.perf_counter() - run_start)
            if delay > 0:
                await asyncio.sleep(delay)
            results[i].scheduled = workload[i].arrival_time
            if semaphore is None:
                await send_request(session, target, bodies[i], results[i], run_start)
            else:
                async with semaphore:
                    await send_request(session, target, bodies[i], results[i], run_start)
            if bar is not None:
                bar.update(1)

        await asyncio.gather(*(one(i) for i in range(len(workload))))
        duration = time.perf_counter() - run_start
    if bar is not None:
        bar.close()
    # Duration as vLLM counts it: from the start to the last response.
    ends = [r.end for r in results if r.e2el > 0]
    if ends:
        duration = max(ends)
    return LoadRun(results, duration if duration > 0 else math.nan, started_at, start_monotonic)


async def fetch_model_info(base_url: str, api_key: str | None = None) -> dict:
    """The first entry of GET /v1/models ({} when the server does not answer it)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), trust_env=False) as session:
        try:
            async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
                if resp.status != 200:
                    return {}
                data = (await resp.json()).get("data") or []
                return data[0] if data else {}
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, json.JSONDecodeError):
            return {}
