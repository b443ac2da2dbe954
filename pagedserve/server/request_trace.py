"""The request trace: where a streamed request's time goes outside the engine's steps.

Written beside the step trace when `--step-trace-path STEPS.jsonl` is set, as
`STEPS.requests.jsonl`, one JSON line per streamed completion (per prompt of it):

    t_http          the server saw the HTTP request (before the body is parsed)
    t_submit        tokenized and validated, handed to the engine front-end
    t_scheduled     the engine first scheduled it                       (engine)
    t_first_token   end of the step that produced its first token       (engine)
    t_first_out     its first token's SSE chunk handed to the HTTP layer
    t_last_token    end of the step that produced its last token        (engine)
    t_last_out      its last token's chunk handed to the HTTP layer

All on one clock, time.monotonic (the engine core stamps its steps with it too), so
`t_first_token` equals the `t_end` of the step-trace line that produced it. `pagedserve
simulate calibrate` fits the serving overhead from these: admission = t_submit - t_http
(per request, growing with the prompt) and delivery = t_first_out - t_first_token (per token
streamed, growing with the number of requests the step fed). Non-streamed requests are not
traced: their one response carries no per-token timing.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path


def request_trace_path(step_trace_path: str | Path) -> Path:
    """STEPS.jsonl -> STEPS.requests.jsonl (the companion of a step trace)."""
    p = Path(step_trace_path)
    return p.with_name(p.stem + ".requests.jsonl") if p.suffix else p.with_name(p.name + ".requests.jsonl")


class ArrivalStamp:
    """ASGI middleware, outermost: stamps time.monotonic() into scope['state']['t_http'] as the
    request reaches the app, before the gate and the body parser run."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["t_http"] = time.monotonic()
        await self.app(scope, receive, send)


def received(request) -> float | None:
    """When ArrivalStamp saw this HTTP request (time.monotonic()), or None outside the app."""
    return getattr(request.state, "t_http", None)


class RequestTrace:
    """Collects one streamed request's server-side timestamps and appends its line when it ends."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "a")
        self._lock = threading.Lock()
        self._arrivals: dict[str, tuple[float | None, float]] = {}

    def arrived(self, request_id: str, t_http: float | None) -> None:
        """The request is about to be handed to the engine (call just before submit)."""
        self._arrivals[request_id] = (t_http, time.monotonic())

    def forget(self, request_id: str) -> None:
        self._arrivals.pop(request_id, None)

    def streamed(self, request_id: str, prompt_lens: list[int], finals: dict, first_out: dict[int, float],
                 last_out: dict[int, float], num_chunks: dict[int, int], num_tokens: dict[int, int]) -> None:
        """The stream ended: one line per prompt that finished (`finals[i]`: its final RequestOutput;
        the dicts are by prompt index: when its first / last token chunk went out, how many chunks
        and tokens it streamed)."""
        t_http, t_submit = self._arrivals.pop(request_id, (None, None))
        lines = []
        for i, out in sorted(finals.items()):
            m = out.metrics[0] if out.metrics else None
            lines.append(json.dumps({
                "request_id": request_id if len(prompt_lens) == 1 else f"{request_id}-{i}",
                "prompt_len": prompt_lens[i] if i < len(prompt_lens) else None,
                "num_tokens": num_tokens.get(i, 0),
                "num_chunks": num_chunks.get(i, 0),
                "t_http": t_http, "t_submit": t_submit,
                "t_scheduled": m.first_scheduled_time if m else None,
                "t_first_token": m.first_token_time if m else None,
                "t_first_out": first_out.get(i),
                "t_last_token": m.last_token_time if m else None,
                "t_last_out": last_out.get(i),
                "num_preemptions": m.num_preemptions if m else 0,
                "num_cached_tokens": m.num_cached_tokens if m else 0,
            }))
        if not lines:
            return
        with self._lock:
            if self._file.closed:
                return
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
