"""The engine-core loop: the one busy loop that owns an EngineCore, in both engine-core modes.

    inbox (wire messages, in order) ─▶ apply: add / finish / pause / resume / watch / shutdown
                                       core.step() while there is work, else core.snapshot()
                                       ─▶ emit(OutputsMsg), then the plug-ins' messages
                                          (PoolView: a SnapshotMsg when a watched view is due)

Thread mode (engine/core_client.py ThreadCoreClient) runs it on a thread of the API process
and its `emit` posts to AsyncLLM; process mode (engine/core_proc.py) runs it as the engine-core
process's main loop, its inbox filled from ZMQ and its emits encoded back. Either way the loop
only ever sees wire messages (engine/core_wire.py), so the two modes cannot drift apart.

Messages apply before the next step, so an abort frees its blocks before that step runs. A
paused loop steps no more and applies only control messages (resume, shutdown, pool
watching); everything else waits in the inbox, in order. Idle (or paused), the loop wakes
every `idle_wait` so gauges stay fresh and `on_idle` can check the world (process mode: is
the API process still there). `run` returns on ShutdownMsg and raises what broke a step:
the caller reports it (thread: to AsyncLLM; process: as DeadMsg).
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

from pagedserve.core.snapshot import SnapshotGate
from pagedserve.engine.core_wire import (CONTROL, AddMsg, FinishMsg, OutputsMsg, PauseMsg, PoolLayout, ResumeMsg,
                                         ShutdownMsg, SnapshotMsg, WatchPoolMsg)

logger = logging.getLogger("pagedserve.engine")

IDLE_WAIT = 0.25


class Inbox:
    """The loop's queue of wire messages. Any thread may put; only the loop takes. A paused
    loop takes only control messages and leaves the rest, in order, for after the resume."""

    def __init__(self) -> None:
        # An RLock: process mode's SIGTERM handler puts from the loop's own thread.
        self._cond = threading.Condition(threading.RLock())
        self._messages: collections.deque = collections.deque()

    def put(self, msg) -> None:
        with self._cond:
            self._messages.append(msg)
            self._cond.notify_all()

    def pending(self) -> list:
        """The messages not yet applied (tests watch a paused loop's inbox through this)."""
        with self._cond:
            return list(self._messages)

    def take(self, timeout: float, paused: bool) -> list:
        """What the loop may apply now, waiting up to `timeout` seconds for a first message."""
        with self._cond:
            if timeout > 0 and not self._takeable(paused):
                self._cond.wait(timeout)
            if not paused:
                messages = list(self._messages)
                self._messages.clear()
                return messages
            control = [m for m in self._messages if isinstance(m, CONTROL)]
            if control:
                self._messages = collections.deque(m for m in self._messages if not isinstance(m, CONTROL))
            return control

    def _takeable(self, paused: bool) -> bool:
        return any(isinstance(m, CONTROL) for m in self._messages) if paused else bool(self._messages)


def pool_layout(core) -> PoolLayout:
    kv = core.scheduler.kv

    def held(name: str) -> int:
        value = getattr(core.executor, name, 0)
        return value if isinstance(value, int) else 0

    return PoolLayout(kv.num_total_blocks, kv.block_size, kv.host_pool.num_blocks if kv.host_pool is not None else 0,
                      core.pool.bytes_per_token, held("weight_bytes"), held("kv_cache_bytes"))


class PoolView:
    """The dashboard's plug-in: after a step, a pool snapshot through the rate/CPU gate
    (core/snapshot.py SnapshotGate), sent as its own message, only while pages watch. A
    snapshot only reads the core: if taking one fails, the pool view stops, the engine does not."""

    def __init__(self, core) -> None:
        self.core = core
        self.gate: SnapshotGate | None = SnapshotGate()

    def watch(self, msg: WatchPoolMsg) -> None:
        if self.gate is None:
            return
        self.gate.max_rate, self.gate.max_share = msg.max_rate, msg.max_share
        self.gate.set_watchers(msg.watchers)

    def after_step(self, emit: Callable[[object], None]) -> None:
        if self.gate is None or not self.gate.watchers:
            return
        try:
            snapshot = self.gate.take(self.core.scheduler)
        except Exception:  # noqa: BLE001
            logger.exception("pool snapshot failed; the dashboard's pool view stops")
            self.gate = None
            return
        if snapshot is not None:
            emit(SnapshotMsg(snapshot))


class CoreLoop:
    def __init__(self, core, inbox: Inbox, emit: Callable[[object], None], idle_wait: float = IDLE_WAIT,
                 on_idle: Callable[[], None] | None = None) -> None:
        self.core = core
        self.inbox = inbox
        self.emit = emit
        self.idle_wait = idle_wait
        self.on_idle = on_idle
        self.num_received = 0   # requests taken in so far (the front-end counts the rest as in flight)
        self.paused = False
        self.stopped = False
        self.pool_view = PoolView(core)

    def request_stop(self) -> None:
        """From any thread, or a signal handler: stop before the next step."""
        self.stopped = True
        self.inbox.put(ShutdownMsg())

    def run(self) -> None:
        core = self.core
        lockstep = core.executor.dp_lockstep
        if lockstep is not None:  # DP attention + EP: this core steps with the others
            self._run_lockstep(lockstep)
            return
        check_health = core.executor.check_health  # a dead rank ends the loop before the next step
        while not self.stopped:
            idle = self.paused or not core.has_unfinished_requests()
            for msg in self.inbox.take(self.idle_wait if idle else 0.0, self.paused):
                self._apply(msg)
            if self.stopped:
                return
            if self.paused:
                if self.on_idle is not None:
                    self.on_idle()
                continue
            check_health()
            if core.has_unfinished_requests():
                outputs = core.step()
            else:
                if self.on_idle is not None:
                    self.on_idle()
                outputs = core.snapshot()  # idle: the gauges still refresh
            self.emit(OutputsMsg(core.observe(outputs), self.num_received))
            self.pool_view.after_step(self.emit)

    def _run_lockstep(self, lockstep) -> None:
        """The loop of one of the data-parallel cores whose MoE layers exchange tokens
        (worker/dp_lockstep.py): every turn the cores agree whether any has work (then each
        steps, or runs a dummy pass where it has nothing to compute) and whether any stops
        (then all do). A paused core takes part with no work of its own."""
        core = self.core
        anyone_busy = False
        while True:
            has_work = not self.paused and core.has_unfinished_requests()
            wait = self.idle_wait if not (has_work or anyone_busy) else 0.0
            for msg in self.inbox.take(wait, self.paused):
                self._apply(msg)
            has_work = not self.paused and core.has_unfinished_requests()
            anyone_busy, stopping = lockstep.agree(has_work, self.stopped)
            if stopping:
                self.stopped = True
                return
            outputs = None
            if has_work:
                forwards = lockstep.num_forwards
                outputs = core.step()
                if lockstep.num_forwards == forwards:  # scheduled nothing this turn: the others still need our experts
                    lockstep.dummy_step()
            elif anyone_busy:
                lockstep.dummy_step()
            elif self.on_idle is not None:
                self.on_idle()
            if self.paused:
                continue
            self.emit(OutputsMsg(core.observe(outputs if outputs is not None else core.snapshot()), self.num_received))
            self.pool_view.after_step(self.emit)

    def _apply(self, msg) -> None:
        if isinstance(msg, AddMsg):
            for data in msg.requests:
                self.core.add_request(data.to_request())
            self.num_received += len(msg.requests)
        elif isinstance(msg, FinishMsg):
            self.core.finish_requests(msg.request_ids, msg.status, msg.stop_reason)
        elif isinstance(msg, PauseMsg):
            self.paused = True
        elif isinstance(msg, ResumeMsg):
            self.paused = False
        elif isinstance(msg, WatchPoolMsg):
            self.pool_view.watch(msg)
        elif isinstance(msg, ShutdownMsg):
            self.stopped = True
        else:
            raise TypeError(f"the engine-core loop got {type(msg).__name__}, which is not a message to the core")
