"""AsyncLLM: the server's front-end. The engine core steps in its own thread; the asyncio
loop tokenizes, validates, turns each step's deltas into outputs and records metrics.

    loop thread                                   engine thread
    submit(): validate, register, queue "add" ─▶  apply commands (add / abort / stop)
                                                  core.step() -> EngineCoreOutputs
    output handler: process_outputs(), metrics ◀─ (call_soon_threadsafe)
      -> per-request asyncio.Queue of RequestOutput deltas; stop strings -> "stop" command

Only the engine thread touches the EngineCore; only the loop touches the OutputProcessor
and the metrics. The engine thread never waits for the loop: detokenization and
everything per-request happen while the next step computes. Commands are applied before
each step, so an abort frees the request's blocks before the next step runs.

A step that raises is fatal (as in vLLM): the core's state is unknown, so every request
in flight and every later one fails with EngineDead, and /health turns 503 naming the error.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Sequence

from pagedserve.core.outputs import EngineCoreOutputs
from pagedserve.core.request import RequestStatus
from pagedserve.engine.output_processor import OutputKind, make_core_requests
from pagedserve.outputs import RequestOutput
from pagedserve.sampling import SamplingParams

logger = logging.getLogger("pagedserve.server")


class EngineOverloaded(Exception):
    """The waiting queue is at --max-queue-len."""


class EngineDead(Exception):
    """The engine is not running (shut down, or a step failed)."""


class AsyncLLM:
    def __init__(self, engine, metrics=None, max_queue_len: int | None = None, idle_wait: float = 0.25) -> None:
        self.engine = engine                       # the parts: input processor, output processor, core
        self.engine_core = engine.engine_core
        self.output_processor = engine.output_processor
        self.output_processor.metrics = metrics
        self.metrics = metrics
        self.max_queue_len = max_queue_len
        self.idle_wait = idle_wait
        self._cond = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._num_pending_adds = 0
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._handler: asyncio.Task | None = None
        self._stop = False
        self._paused = False  # tests: hold the thread so queue states can be set up exactly
        self.dead_error: BaseException | None = None
        self._num_waiting_in_core = 0
        # The dashboard's seams (server/dashboard.py): a gate saying when the engine thread
        # takes a pool snapshot, and callables the loop hands every step's outputs to.
        self.pool_snapshots = None   # core.snapshot.SnapshotGate | None
        self.step_listeners: list = []
        self._publish_metrics(self.engine_core.snapshot())  # the pool size is known before the first request

    # -- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread and the output handler (call from the serving loop)."""
        if self.is_running:
            return
        self._loop = asyncio.get_running_loop()
        self._stop = False
        self._handler_queue: asyncio.Queue = asyncio.Queue()
        self._handler = self._loop.create_task(self._handle_outputs())
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._handler is not None:
            self._handler.cancel()
            self._handler = None
        self._fail_all(EngineDead("the server is shutting down"))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

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
        return self._num_pending_adds + self._num_waiting_in_core

    def submit(self, entries: Sequence[tuple[str, str | None, Sequence[int]]], params: SamplingParams,
               priority: int = 0, kind: OutputKind = OutputKind.DELTA) -> asyncio.Queue:
        """Queue requests (id, prompt text, token ids; already validated) that share params and
        one output queue: all of them, or none (EngineOverloaded, EngineDead)."""
        if not self.is_running:
            raise EngineDead(f"the engine is not running{self._dead_detail()}")
        queue: asyncio.Queue = asyncio.Queue()
        with self._cond:
            if self.max_queue_len is not None and self.num_waiting + len(entries) > self.max_queue_len:
                raise EngineOverloaded(f"the waiting queue is full ({self.num_waiting} of {self.max_queue_len} "
                                       f"requests); retry later")
            arrival = time.monotonic()
            engine = self.engine
            for request_id, text, token_ids in entries:
                core_requests = make_core_requests(request_id, list(token_ids), params, engine.eos_token_ids,
                                                   arrival, priority, engine.config.max_model_len)
                self.output_processor.add_request(request_id, text, list(token_ids), core_requests, kind)
                self._queues[request_id] = queue
                self._commands.append(("add", core_requests))
                self._num_pending_adds += len(core_requests)
            self._cond.notify_all()
        return queue

    def abort(self, request_id: str) -> None:
        """End a request (a no-op once it finished); its blocks return before the next step."""
        self._queues.pop(request_id, None)
        core_ids = self.output_processor.abort_request(request_id)
        if core_ids:
            self._command(("finish", core_ids, RequestStatus.FINISHED_ABORTED, None))

    def _command(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify_all()

    def _dead_detail(self) -> str:
        return f": {type(self.dead_error).__name__}: {self.dead_error}" if self.dead_error is not None else ""

    async def _handle_outputs(self) -> None:
        while True:
            item = await self._handler_queue.get()
            if isinstance(item, BaseException):
                self.dead_error = item
                self._fail_all(EngineDead(f"the engine failed: {type(item).__name__}: {item}"))
                continue
            self._process(item)

    def _process(self, core_outputs: EngineCoreOutputs) -> None:
        self._num_waiting_in_core = core_outputs.stats.num_waiting
        processed = self.output_processor.process_outputs(core_outputs)
        for core_id, stop in processed.stopped:
            self._command(("finish", [core_id], RequestStatus.FINISHED_STOPPED, stop))
        for out in processed.request_outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue
            try:
                self._process_output(queue, out)
            except Exception as e:  # noqa: BLE001 - one request's failure is that request's alone
                logger.exception("delivering the output of request %s failed", out.request_id)
                self.abort(out.request_id)
                queue.put_nowait((out.request_id, e))
        self._publish_metrics(core_outputs)
        for listener in self.step_listeners:
            try:
                listener(core_outputs)
            except Exception:  # noqa: BLE001 - a watcher's failure must not stop the serving
                logger.exception("step listener %r failed", listener)

    def _process_output(self, queue: asyncio.Queue, out: RequestOutput) -> None:
        if out.finished:
            self._queues.pop(out.request_id, None)
        queue.put_nowait((out.request_id, out))

    def _publish_metrics(self, core_outputs: EngineCoreOutputs) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        stats = core_outputs.stats
        if core_outputs.step_time:
            metrics.record_step(stats, core_outputs.step_time, core_outputs.forward_time, stats.num_batched_tokens)
        metrics.set_state(running=stats.num_running, waiting=self._num_pending_adds + stats.num_waiting,
                          swapped=stats.num_swapped, used_blocks=stats.num_used_blocks,
                          total_blocks=stats.num_total_blocks, block_size=self.engine.config.block_size)
        metrics.tick()

    def _fail_all(self, error: BaseException) -> None:
        """Every request in flight ends with `error` (the engine thread is gone or never will step)."""
        for request_id, queue in list(self._queues.items()):
            self.output_processor.abort_request(request_id)
            queue.put_nowait((request_id, error))
        self._queues.clear()

    # -- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        core = self.engine_core
        while True:
            with self._cond:
                while not self._stop and (self._paused or (not self._commands and not core.has_unfinished_requests())):
                    self._cond.wait(self.idle_wait)
                    if not self._paused:
                        break  # wake up now and then so idle gauges and the log line stay fresh
                if self._stop:
                    return
                commands = list(self._commands)
                self._commands.clear()
            try:
                self._apply(commands)
                outputs = core.step() if core.has_unfinished_requests() else core.snapshot()
            except BaseException as e:  # noqa: BLE001 - fatal, whatever it is: the core's state is unknown
                logger.exception("engine step failed; the engine is dead")
                self._post(e)
                return
            if self.pool_snapshots is not None:
                self._attach_pool_snapshot(outputs)
            self._post(outputs)

    def _attach_pool_snapshot(self, outputs: EngineCoreOutputs) -> None:
        """A snapshot only reads the core: if it fails, the pool view stops, the engine does not."""
        try:
            outputs.pool_snapshot = self.pool_snapshots.take(self.engine_core.scheduler)
        except Exception:  # noqa: BLE001
            logger.exception("pool snapshot failed; the dashboard's pool view stops")
            self.pool_snapshots = None

    def _apply(self, commands: list[tuple]) -> None:
        core = self.engine_core
        for command in commands:
            if command[0] == "add":
                for req in command[1]:
                    core.add_request(req)
                with self._cond:
                    self._num_pending_adds -= len(command[1])
            else:
                _, core_ids, status, stop_reason = command
                core.finish_requests(core_ids, status, stop_reason)

    def _post(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._handler_queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
