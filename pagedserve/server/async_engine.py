"""AsyncEngine: the Engine stepping in its own thread while an asyncio loop serves HTTP.

The Engine is not thread-safe, so only the engine thread touches it (validation and
tokenization only read, and may run on the loop). The loop hands the thread commands
(add, abort) through a deque under a condition variable; the thread applies them before
each step, so an abort frees the request's blocks before the next step runs. Outputs go back
to each request's asyncio.Queue with call_soon_threadsafe.

Several engine requests may share one queue (a completions call with several prompts):
every item on it is (request_id, RequestOutput | Exception).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from pagedserve.metrics import EngineMetrics
from pagedserve.outputs import RequestOutput
from pagedserve.sampling import SamplingParams

logger = logging.getLogger("pagedserve.server")


class EngineOverloaded(Exception):
    """The waiting queue is at --max-queue-len."""


class EngineDead(Exception):
    """The engine thread is not running."""


@dataclass
class _Tracked:
    """Loop-facing state of one engine request, kept by the engine thread."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    num_prompt_tokens: int
    num_samples: int
    tokens_seen: list[int] = field(default_factory=list)
    last_token_time: list[float | None] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)


class AsyncEngine:
    def __init__(self, engine, metrics: EngineMetrics | None = None, max_queue_len: int | None = None,
                 idle_wait: float = 0.25) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue_len = max_queue_len
        self.idle_wait = idle_wait
        self._cond = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._num_pending_adds = 0
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._paused = False  # tests: hold the thread so queue states can be set up exactly
        self._refresh_gauges()  # the pool size is known before the first request

    # -- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    # -- loop side ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests not yet running: accepted but not handed to the engine, plus its waiting queue."""
        return self._num_pending_adds + self.engine.scheduler.num_waiting

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
               priority: int = 0) -> asyncio.Queue:
        """Queue one request (already validated); raises EngineOverloaded without queueing anything."""
        return self.submit_batch([(request_id, prompt_token_ids)], params, priority)

    def submit_batch(self, entries: Sequence[tuple[str, Sequence[int]]], params: SamplingParams,
                     priority: int = 0) -> asyncio.Queue:
        """Queue several requests that share params and one output queue: all of them, or none."""
        if not self.is_running:
            raise EngineDead("the engine thread is not running")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._cond:
            if self.max_queue_len is not None and self.num_waiting + len(entries) > self.max_queue_len:
                raise EngineOverloaded(f"the waiting queue is full ({self.num_waiting} of {self.max_queue_len} "
                                       f"requests); retry later")
            arrival = time.monotonic()
            for request_id, token_ids in entries:
                tracked = _Tracked(queue, loop, len(token_ids), params.n, [0] * params.n, [None] * params.n,
                                   [False] * params.n)
                self._commands.append(("add", request_id, list(token_ids), params, priority, arrival, tracked))
                self._num_pending_adds += 1
            self._cond.notify_all()
        return queue

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._commands.append(("abort", request_id))
            self._cond.notify_all()

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs until finished; a caller that stops early aborts the request."""
        queue = self.submit(request_id, prompt_token_ids, params, priority)
        finished = False
        try:
            while True:
                _, item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    # -- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._stop and (self._paused or (not self._commands
                                                           and not engine.has_unfinished_requests())):
                    self._cond.wait(self.idle_wait)
                    if not self._paused:
                        break  # wake up now and then to refresh gauges and the log line
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
            try:
                for command in commands:
                    self._apply(command)
                if engine.has_unfinished_requests():
                    self._step()
                self._refresh_gauges()
            except Exception as e:  # noqa: BLE001 - the thread must outlive any one bad moment
                logger.exception("engine loop error; failing the requests in flight")
                self._fail_all(e)
        self._fail_all(EngineDead("the server is shutting down"))

    def _apply(self, command) -> None:
        if command[0] == "add":
            _, request_id, token_ids, params, priority, arrival, tracked = command
            try:
                self.engine.add_request(request_id, token_ids, params, arrival_time=arrival, priority=priority)
            except Exception as e:  # noqa: BLE001 - reported to that request only
                self._deliver(tracked, request_id, e)
            else:
                self._tracked[request_id] = tracked
            finally:
                with self._cond:
                    self._num_pending_adds -= 1
        else:
            request_id = command[1]
            tracked = self._tracked.pop(request_id, None)
            if self.engine.abort(request_id) and tracked is not None and self.metrics is not None:
                for done in tracked.finished:
                    if not done:
                        self.metrics.record_finished("abort", tracked.num_prompt_tokens, 0, None)

    def _step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001
            # We cannot tell which request broke the step: fail every request in flight so none
            # hangs, and keep serving the ones that come next.
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all(e)
            return
        result = engine.last_step_result
        if self.metrics is not None:
            self.metrics.record_step(engine.last_stats, getattr(result, "duration", 0.0),
                                     getattr(result, "forward_time", 0.0), self.engine.last_stats.num_batched_tokens)
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            try:
                self._process_output(tracked, out)
            except Exception as e:  # noqa: BLE001 - one request's failure is that request's alone
                logger.exception("processing the output of request %s failed", out.request_id)
                self._tracked.pop(out.request_id, None)
                engine.abort(out.request_id)
                self._deliver(tracked, out.request_id, e)

    def _process_output(self, tracked: _Tracked, out: RequestOutput) -> None:
        if self.metrics is not None:
            self._record(tracked, out)
        if out.finished:
            self._tracked.pop(out.request_id, None)
        self._deliver(tracked, out.request_id, out)

    def _record(self, tracked: _Tracked, out: RequestOutput) -> None:
        metrics = self.metrics
        for comp, m in zip(out.outputs, out.metrics):
            i = comp.index
            num_tokens = len(comp.token_ids)
            num_new = num_tokens - tracked.tokens_seen[i]
            if num_new > 0:
                if tracked.tokens_seen[i] == 0 and m.first_token_time is not None:
                    metrics.record_first_token(tracked.num_prompt_tokens, m.arrival_time, m.first_token_time)
                    metrics.record_new_tokens(num_new, None)
                else:
                    prev, now = tracked.last_token_time[i], m.last_token_time
                    metrics.record_new_tokens(num_new, now - prev if prev is not None and now is not None else None)
                tracked.tokens_seen[i] = num_tokens
                tracked.last_token_time[i] = m.last_token_time
            if comp.finish_reason is not None and not tracked.finished[i]:
                tracked.finished[i] = True
                metrics.record_finished(comp.finish_reason, tracked.num_prompt_tokens, num_tokens, m)

    def _deliver(self, tracked: _Tracked, request_id: str, item) -> None:
        try:
            tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, (request_id, item))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _fail_all(self, error: BaseException) -> None:
        for request_id, tracked in list(self._tracked.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - still tell the client
                logger.exception("abort of %s failed", request_id)
            self._deliver(tracked, request_id, error)
        self._tracked.clear()
        with self._cond:
            pending = [c for c in self._commands if c[0] == "add"]
            self._commands.clear()
            self._num_pending_adds -= len(pending)
        for c in pending:
            self._deliver(c[6], c[1], error)

    def _refresh_gauges(self) -> None:
        if self.metrics is None:
            return
        engine = self.engine
        scheduler = engine.scheduler
        swapped = getattr(scheduler, "num_swapped", None)
        if swapped is None:
            swapped = engine.last_stats.num_swapped if engine.has_unfinished_requests() else 0
        self.metrics.set_state(
            running=scheduler.num_running,
            waiting=self.num_waiting,
            swapped=swapped,
            used_blocks=engine.kv_cache_manager.num_used_blocks,
            total_blocks=engine.block_pool.num_blocks,
            block_size=engine.config.block_size,
        )
        self.metrics.tick()
