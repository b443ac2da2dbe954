"""AsyncLLM: the server's front-end. The engine core steps elsewhere (a thread of this
process, or its own process: engine/core_client.py); the asyncio loop tokenizes, validates,
turns each step's deltas into outputs and records metrics.

    loop thread                                   engine-core loop (thread or process)
    submit(): validate, register, AddMsg      ─▶  apply messages (add / finish / pause / ...)
                                                  core.step() -> EngineCoreOutputs
    output handler: process_outputs(), metrics ◀─ (the CoreClient posts onto the loop;
      -> per-request asyncio.Queue of RequestOutput     pool snapshots, when watched, too)
         deltas; stop strings -> FinishMsg

Only the engine core's side touches the EngineCore; only the loop touches the
OutputProcessor and the metrics. The core never waits for the loop: detokenization and
everything per-request happen while the next step computes. Commands are applied before
each step, so an abort frees the request's blocks before the next step runs.

A step that raises, or an engine core (or one of its ranks) that dies, is fatal (as in
vLLM): the core's state is unknown, so every request in flight and every later one fails
with EngineDead, /health turns 503 naming the error, and each `on_dead` callback runs
(`pagedserve serve` then exits non-zero).

A core that is alive but makes no progress (stopped, stuck in a step) is caught by the step
watchdog, here on the loop's side, because a frozen core cannot report itself: when there is
work and nothing has come from the core for longer than the bound, `stall` is set (/health
turns 503 naming the stuck process, `engine_stalls_total` counts it); the core's next
output clears it. Not fatal: a step that was merely long resumes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pagedserve.core.outputs import EngineCoreOutputs
from pagedserve.core.request import RequestStatus
from pagedserve.core.snapshot import PoolSnapshot
from pagedserve.engine.core_client import CoreClient, EngineCoreDied, ThreadCoreClient
from pagedserve.engine.output_processor import OutputKind, make_core_requests
from pagedserve.outputs import RequestOutput
from pagedserve.sampling import SamplingParams

logger = logging.getLogger("pagedserve.server")


class EngineOverloaded(Exception):
    """The request's sequences would take the waiting queue past --max-queue-len."""


class EngineDead(Exception):
    """The engine is not running (shut down, or a step failed)."""


# The step watchdog's bound when none is given: STALL_MARGIN times the longest step to expect,
# which is the slower of the slowest step seen and a full prefill chunk (max_num_batched_tokens)
# extrapolated from the largest step measured; never under the floor; and until a step was
# measured, the warm-up bound (the first steps may compile kernels).
STALL_MARGIN = 10.0
STALL_FLOOR_SECONDS = 10.0
STALL_WARMUP_SECONDS = 60.0


@dataclass
class Stall:
    """No output from the engine core since `since` (monotonic), with work outstanding."""

    since: float
    bound: float
    num_requests: int
    suspects: list[dict] = field(default_factory=list)  # core_client.held_processes()
    core: str = "the engine core"

    @property
    def rank(self) -> int | None:
        """The tensor-parallel rank that cannot run, if one is the cause."""
        return next((s["rank"] for s in self.suspects if s["rank"] is not None), None)

    @property
    def pid(self) -> int | None:
        return self.suspects[0]["pid"] if self.suspects else None

    def seconds(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.since

    def message(self, now: float | None = None) -> str:
        head = (f"engine stalled: no engine step has completed for {self.seconds(now):.1f} s with "
                f"{self.num_requests} request{'s' if self.num_requests != 1 else ''} in flight "
                f"(bound {self.bound:g} s, --step-watchdog-timeout)")
        if self.suspects:
            return head + "; " + "; ".join(f"{s['who']} (pid {s['pid']}) is {s['state']}" for s in self.suspects)
        return head + f"; no engine process is stopped: {self.core} is inside one step longer than the bound"

    def to_dict(self, now: float | None = None) -> dict:
        return {"reason": "engine_stalled", "rank": self.rank, "pid": self.pid,
                "stalled_seconds": round(self.seconds(now), 3), "bound_seconds": self.bound,
                "suspects": self.suspects}
class ServerShuttingDown(EngineDead):
    """The server is draining (server/drain.py): the request was refused, or ended at the
    cut-off; another replica can take it."""


class AsyncLLM:
    def __init__(self, engine, metrics=None, max_queue_len: int | None = None, idle_wait: float = 0.25,
                 client: CoreClient | None = None, step_watchdog_timeout: float | None = None) -> None:
        """`engine`: the front-end parts (an Engine, or an EngineFrontend when `client` runs
        the core in another process). Without `client` the Engine's core steps in a thread.
        `step_watchdog_timeout`: seconds without a step, while there is work, before the
        engine counts as stalled; None = derived from measured steps (watchdog_bound),
        0 = no watchdog."""
        self.engine = engine
        self.client: CoreClient = client if client is not None else ThreadCoreClient(engine.engine_core, idle_wait)
        self.output_processor = engine.output_processor
        self.output_processor.metrics = metrics
        self.metrics = metrics
        self.max_queue_len = max_queue_len
        self.on_dead: list[Callable[[BaseException], None]] = []
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handler: asyncio.Task | None = None
        self._started = False
        self.dead_error: BaseException | None = None
        self.refusal: str | None = None  # set by stop_accepting(): why submit() refuses
        self._num_waiting_in_core = 0
        self.step_watchdog_timeout = step_watchdog_timeout
        self.stall: Stall | None = None
        self._last_output = time.monotonic()  # when the core last posted (written by the client's thread)
        self._slowest_step = 0.0
        self._largest_step = (0, 0.0)  # (batched tokens, seconds) of the step with the most tokens
        self._watchdog: asyncio.Task | None = None
        # The dashboard's seam (dashboard/routes.py): callables the loop hands every step's
        # outputs to, and every pool snapshot the core sent (it sends them while `watch_pool`
        # says pages watch: engine/core_loop.py PoolView).
        self.step_listeners: list = []
        self.snapshot_listeners: list = []
        self.pool_snapshots = None  # the dashboard's watcher count and rate (dashboard/routes.py PoolWatch)
        self._publish_metrics(self.client.initial_snapshot())  # the pool size is known before the first request

    @property
    def engine_core(self):
        """The EngineCore when it steps in this process (the thread client); None when it runs
        in an engine-core process."""
        return self.client.engine_core

    # -- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine core's side and the output handler (call from the serving loop)."""
        if self.is_running:
            return
        self._loop = asyncio.get_running_loop()
        self._handler_queue: asyncio.Queue = asyncio.Queue()
        self._handler = self._loop.create_task(self._handle_outputs())
        self._started = True
        self._last_output = time.monotonic()
        if self.step_watchdog_timeout != 0:
            self._watchdog = self._loop.create_task(self._watch_steps())
        self.client.start(self._post)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.client.shutdown(timeout)
        self._started = False
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._handler is not None:
            self._handler.cancel()
            self._handler = None
        self._fail_all(EngineDead("the server is shutting down"))

    @property
    def is_running(self) -> bool:
        return self._started and self.dead_error is None and self.client.is_alive()

    def death_reason(self) -> str | None:
        """Why the engine is not running, as far as is known now: also in the moment between a
        core's death and the loop handling the news of it (the first /health answer names it)."""
        if self.dead_error is not None:
            return f"{type(self.dead_error).__name__}: {self.dead_error}"
        reason = self.client.death_reason()
        return None if reason is None else f"{EngineCoreDied.__name__}: {reason}"

    def stop_accepting(self, message: str) -> None:
        """The drain's cut-off: every request in flight ends with ServerShuttingDown(message)
        (its blocks return before the next step), and submit() refuses from now on."""
        self.refusal = message
        error = ServerShuttingDown(message)
        for request_id, queue in list(self._queues.items()):
            self.abort(request_id)
            queue.put_nowait((request_id, error))

    def pause(self) -> None:
        self.client.pause()

    def resume(self) -> None:
        self.client.resume()

    # -- loop side ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests not yet running: accepted but not yet in the core, plus its waiting queue."""
        return self.client.num_pending_adds + self._num_waiting_in_core

    def submit(self, entries: Sequence[tuple[str, str | None, Sequence[int]]], params: SamplingParams,
               priority: int = 0, kind: OutputKind = OutputKind.DELTA, arrival: float | None = None
               ) -> asyncio.Queue:
        """Queue requests (id, prompt text, token ids; already validated) that share params and
        one output queue: all of them, or none (EngineOverloaded, EngineDead). `arrival`: when
        they came (time.monotonic(), e.g. the HTTP request's stamp; default now), which TTFT, E2E
        latency, queue time and first-come order count from."""
        if self.refusal is not None:
            raise ServerShuttingDown(self.refusal)
        if not self.is_running:
            raise EngineDead(f"the engine is not running{self._dead_detail()}")
        # The queue counts sequences, as the core does: a prompt with n samples is n of them.
        num_new = len(entries) * params.n
        if self.max_queue_len is not None and self.num_waiting + num_new > self.max_queue_len:
            raise EngineOverloaded(f"the waiting queue is full ({self.num_waiting} of {self.max_queue_len} "
                                   f"sequences wait; this request adds {num_new}); retry later")
        queue: asyncio.Queue = asyncio.Queue()
        now = time.monotonic()
        arrival = now if arrival is None else min(arrival, now)
        if not self._has_work():  # the watchdog's clock for this work starts now, not at the last idle output
            self._last_output = max(self._last_output, now)
        engine = self.engine
        batch = []
        for request_id, text, token_ids in entries:
            core_requests = make_core_requests(request_id, list(token_ids), params, engine.eos_token_ids,
                                               arrival, priority, engine.config.max_model_len)
            self.output_processor.add_request(request_id, text, list(token_ids), core_requests, kind)
            self._queues[request_id] = queue
            batch.extend(core_requests)
        try:
            self.client.add_requests(batch)
        except EngineCoreDied as e:  # died before its death was posted: refuse, change nothing
            for request_id, _, _ in entries:
                self._queues.pop(request_id, None)
                self.output_processor.abort_request(request_id)
            raise EngineDead(f"the engine is not running: {e}") from None
        return queue

    def abort(self, request_id: str) -> None:
        """End a request (a no-op once it finished); its blocks return before the next step."""
        self._queues.pop(request_id, None)
        core_ids = self.output_processor.abort_request(request_id)
        if core_ids and self.dead_error is None:
            self._finish(core_ids, RequestStatus.FINISHED_ABORTED, None)

    def _finish(self, core_ids: list[str], status: RequestStatus, stop_reason) -> None:
        try:
            self.client.finish_requests(core_ids, status, stop_reason)
        except EngineCoreDied:
            pass  # the core is gone: its death reaches _handle_outputs and fails everyone

    def _dead_detail(self) -> str:
        return f": {type(self.dead_error).__name__}: {self.dead_error}" if self.dead_error is not None else ""

    def _post(self, item) -> None:
        """Called from the client's thread: hand a step's outputs (or the fatal error) to the loop."""
        if not isinstance(item, BaseException):
            self._last_output = time.monotonic()  # the watchdog's clock: the core is alive and stepping
        try:
            self._loop.call_soon_threadsafe(self._handler_queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def _handle_outputs(self) -> None:
        while True:
            item = await self._handler_queue.get()
            if isinstance(item, BaseException):
                if self.dead_error is None:
                    self._die(item)
                continue
            if isinstance(item, PoolSnapshot):
                self._notify(self.snapshot_listeners, item)
                continue
            self._process(item)

    def _die(self, error: BaseException) -> None:
        self.dead_error = error
        logger.error("the engine died: %s: %s", type(error).__name__, error)
        self._fail_all(EngineDead(f"the engine failed: {type(error).__name__}: {error}"))
        for callback in self.on_dead:
            callback(error)

    # -- the step watchdog ----------------------------------------------------------------
    @property
    def watchdog_bound(self) -> float | None:
        """Seconds without output, with work outstanding, before the engine counts as stalled."""
        if self.step_watchdog_timeout == 0:
            return None
        if self.step_watchdog_timeout is not None:
            return float(self.step_watchdog_timeout)
        tokens, seconds = self._largest_step
        if not tokens:
            return STALL_WARMUP_SECONDS
        full_chunk = seconds * self.engine.config.max_num_batched_tokens / tokens
        return max(STALL_FLOOR_SECONDS, STALL_MARGIN * max(self._slowest_step, full_chunk))

    def observe_step(self, step_time: float, num_batched_tokens: int) -> None:
        """A completed step, for the watchdog's derived bound."""
        self._slowest_step = max(self._slowest_step, step_time)
        tokens, seconds = self._largest_step
        if num_batched_tokens > tokens or (num_batched_tokens == tokens and step_time > seconds):
            self._largest_step = (num_batched_tokens, step_time)

    def _has_work(self) -> bool:
        return bool(self._queues) or self.client.num_pending_adds > 0

    async def _watch_steps(self) -> None:
        while (bound := self.watchdog_bound) is not None:
            await asyncio.sleep(min(1.0, max(bound / 4, 0.05)))
            try:
                self.check_stall()
            except Exception:  # noqa: BLE001 - the watchdog must not die of a /proc read
                logger.exception("the step watchdog failed a check")

    def check_stall(self, now: float | None = None) -> Stall | None:
        """Set (or refresh) `stall` if there is work and the core has been silent past the bound."""
        now = time.monotonic() if now is None else now
        bound = self.watchdog_bound
        if bound is None or self.dead_error is not None or not self._started or not self._has_work():
            return self.stall
        since = self._last_output
        if now - since <= bound:
            return self.stall
        first = self.stall is None
        self.stall = Stall(since, bound, len(self._queues), self.client.stall_suspects(), self.client.describe())
        if first:
            logger.warning("%s", self.stall.message(now))
            if self.metrics is not None:
                self.metrics.set_stalled(True)
        return self.stall

    def _recover(self) -> None:
        logger.warning("the engine stepped again after %.1f s; /health is 200 again", self.stall.seconds())
        self.stall = None
        if self.metrics is not None:
            self.metrics.set_stalled(False)

    def _process(self, core_outputs: EngineCoreOutputs) -> None:
        if self.stall is not None:
            self._recover()
        if core_outputs.step_time and core_outputs.stats.num_batched_tokens:
            self.observe_step(core_outputs.step_time, core_outputs.stats.num_batched_tokens)
        self._num_waiting_in_core = core_outputs.stats.num_waiting
        processed = self.output_processor.process_outputs(core_outputs)
        for core_id, stop in processed.stopped:
            self._finish([core_id], RequestStatus.FINISHED_STOPPED, stop)
        for request_id, message in processed.failed:
            # The request could not be honoured: it ends with an error (400 naming its constraint's
            # field, or an SSE error event), never with the text generated so far. Its other
            # samples, if any, are aborted.
            queue = self._queues.get(request_id)
            logger.warning("request %s failed: %s", request_id, message)
            self.abort(request_id)
            if queue is not None:
                queue.put_nowait((request_id, ValueError(message)))
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
        self._notify(self.step_listeners, core_outputs)

    @staticmethod
    def _notify(listeners: list, item) -> None:
        for listener in listeners:
            try:
                listener(item)
            except Exception:  # noqa: BLE001 - a watcher's failure must not stop the serving
                logger.exception("listener %r failed", listener)

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
        metrics.set_state(running=stats.num_running, waiting=self.client.num_pending_adds + stats.num_waiting,
                          swapped=stats.num_swapped, used_blocks=stats.num_used_blocks,
                          total_blocks=stats.num_total_blocks, block_size=self.engine.config.block_size)
        if core_outputs.kv_events_published or core_outputs.kv_events_dropped:
            metrics.set_kv_events(core_outputs.kv_events_published, core_outputs.kv_events_dropped)
        metrics.tick()

    def _fail_all(self, error: BaseException) -> None:
        """Every request in flight ends with `error` (the engine is gone or never will step)."""
        for request_id, queue in list(self._queues.items()):
            self.output_processor.abort_request(request_id)
            queue.put_nowait((request_id, error))
        self._queues.clear()
