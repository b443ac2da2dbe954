"""The seam between a front-end (AsyncLLM) and its engine core: in a thread, or in its own
process.

    ThreadCoreClient    the EngineCore steps in a thread of this process (commands through a
                        deque under a condition variable)
    ProcessCoreClient   the EngineCore runs in an engine-core process (engine/core_proc.py),
                        fed over ZMQ: requests and finishes go in as msgspec messages, each
                        step's EngineCoreOutputs come back the same way

Both hand every step's EngineCoreOutputs, and a fatal error as an exception, to `post`
(called from a thread of theirs; AsyncLLM moves it onto its event loop). Neither waits for
the event loop: the core steps while the loop detokenizes. The front-end sends plain data
(EngineCoreRequest: ids, prompt token ids, SamplingParams, eos ids, arrival, priority) and
keeps everything textual on its side.

Faults in the process client: a core that fails sends the error (naming a dead rank, if
that was the cause) and exits 1; a core that vanishes (SIGKILL) is noticed by its process
sentinel within RECV_POLL_SECONDS. Either way `post` gets an EngineCoreDied.
"""
from __future__ import annotations

import collections
import logging
import os
import tempfile
import threading
import time
import uuid
from typing import Callable

from pagedserve.core.outputs import EngineCoreOutputs
from pagedserve.core.request import EngineCoreRequest, Request, RequestStatus
from pagedserve.engine.core_wire import (ENCODER, FROM_CORE_DECODER, AddMsg, DeadMsg, FinishMsg, OutputsMsg, ReadyMsg,
                                         ShutdownMsg)

logger = logging.getLogger("pagedserve.server")

RECV_POLL_SECONDS = 0.2


class EngineCoreDied(RuntimeError):
    """The engine core (its thread, its process, or one of its ranks) is gone."""


_HELD_STATES = {"T": "stopped (SIGSTOP)", "t": "stopped by a tracer", "D": "in uninterruptible sleep (D)"}


def held_state(pid: int) -> str | None:
    """Why a live process cannot run, from /proc (Linux): stopped, or in uninterruptible sleep;
    None if it can run (or is gone, or /proc is not there)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return _HELD_STATES.get(state)


def held_processes(named: list[tuple[str, int | None, int]]) -> list[dict]:
    """Of (who, tensor-parallel rank or None, pid), those that cannot run, as the step
    watchdog reports them: {"who", "rank", "pid", "state"}."""
    out = []
    for who, rank, pid in named:
        state = held_state(pid)
        if state is not None:
            out.append({"who": who, "rank": rank, "pid": pid, "state": state})
    return out


# -- in a thread -----------------------------------------------------------------------
class ThreadCoreClient:
    """The engine core steps in a thread of this process. Only that thread touches it."""

    def __init__(self, engine_core, idle_wait: float = 0.25) -> None:
        self.engine_core = engine_core
        self.idle_wait = idle_wait
        self._cond = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._num_pending_adds = 0
        self._thread: threading.Thread | None = None
        self._post: Callable[[object], None] | None = None
        self._stop = False
        self._paused = False  # tests: hold the thread so queue states can be set up exactly
        self._death: BaseException | None = None
        self.pool_snapshots = None  # core.snapshot.SnapshotGate | None: the dashboard's pool view

    def initial_snapshot(self) -> EngineCoreOutputs:
        return self.engine_core.snapshot()

    @property
    def num_pending_adds(self) -> int:
        return self._num_pending_adds

    def describe(self) -> str:
        return "the engine thread"

    def stall_suspects(self) -> list[dict]:
        """Processes of this engine that cannot run (its tensor-parallel ranks, if any; the
        engine thread itself is in this process, which is running)."""
        pids = list(getattr(self.engine_core.executor, "pids", []) or [])
        return held_processes([(f"tensor-parallel rank {i}", i, pid) for i, pid in enumerate(pids)])

    def start(self, post: Callable[[object], None]) -> None:
        self._post = post
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def death_reason(self) -> str | None:
        """Why the engine thread ended, once it did of a failure (None while it runs or after a shutdown)."""
        if self._death is not None:
            return f"the engine thread failed: {type(self._death).__name__}: {self._death}"
        return None

    def add_requests(self, requests: list[Request]) -> None:
        with self._cond:
            self._commands.append(("add", requests))
            self._num_pending_adds += len(requests)
            self._cond.notify_all()

    def finish_requests(self, request_ids: list[str], status: RequestStatus, stop_reason=None) -> None:
        with self._cond:
            self._commands.append(("finish", request_ids, status, stop_reason))
            self._cond.notify_all()

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.engine_core.shutdown()

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
                check_health = getattr(core.executor, "check_health", None)
                if check_health is not None:
                    check_health()
                outputs = core.observe(core.step() if core.has_unfinished_requests() else core.snapshot())
            except BaseException as e:  # noqa: BLE001 - fatal, whatever it is: the core's state is unknown
                logger.exception("engine step failed; the engine is dead")
                self._death = e
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


# -- in its own process -----------------------------------------------------------------
class ProcessCoreClient:
    """The engine core in an engine-core process, over two ZMQ IPC sockets (PUSH requests in,
    PULL outputs back). Built synchronously: returns once the core has loaded the model and
    sized its pool, or raises what stopped it (a ValueError for a bad knob)."""

    def __init__(self, config, eos_token_ids: frozenset[int], start_timeout: float = 900.0) -> None:
        import torch.multiprocessing as tmp
        import zmq

        from pagedserve.engine.core_proc import run_engine_core

        self._ctx = zmq.Context()
        base = os.path.join(tempfile.gettempdir(), f"pagedserve-{uuid.uuid4().hex[:12]}")
        self._paths = [f"{base}-in", f"{base}-out"]
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)  # never block a send on a live core; a dead one: see _send
        self._in.bind(f"ipc://{self._paths[0]}")
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(f"ipc://{self._paths[1]}")
        self._send_lock = threading.Lock()
        self._num_sent = 0
        self._num_received = 0
        self._post: Callable[[object], None] | None = None
        self._receiver: threading.Thread | None = None
        self._closing = False
        self._death: EngineCoreDied | None = None
        self.worker_pids: list[int] = []
        spawn = tmp.get_context("spawn")
        self.process = spawn.Process(target=run_engine_core, name="pagedserve-engine-core",
                                     args=(config, sorted(eos_token_ids), f"ipc://{self._paths[0]}",
                                           f"ipc://{self._paths[1]}"), daemon=False)
        self.process.start()
        try:
            ready = self._wait_ready(start_timeout)
        except BaseException:
            self._stop_process(5.0)
            self._close_sockets()
            raise
        self._snapshot = ready.snapshot
        self.worker_pids = list(ready.worker_pids)
        logger.info("engine core process pid %d%s", self.process.pid,
                    f", tensor-parallel ranks {self.worker_pids}" if self.worker_pids else "")

    def _wait_ready(self, timeout: float) -> ReadyMsg:
        import zmq

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._out.poll(int(RECV_POLL_SECONDS * 1000), zmq.POLLIN):
                msg = FROM_CORE_DECODER.decode(self._out.recv())
                if isinstance(msg, ReadyMsg):
                    return msg
                if isinstance(msg, DeadMsg):
                    raise (ValueError if msg.bad_config else EngineCoreDied)(msg.error)
            elif not self.process.is_alive():
                raise EngineCoreDied(f"the engine core process (pid {self.process.pid}) died while starting: "
                                     f"{_describe_exit(self.process.exitcode)}")
        raise EngineCoreDied(f"the engine core process did not start within {timeout:.0f} s")

    def initial_snapshot(self) -> EngineCoreOutputs:
        return self._snapshot

    @property
    def num_pending_adds(self) -> int:
        return max(0, self._num_sent - self._num_received)

    def describe(self) -> str:
        return f"the engine core process (pid {self.process.pid})"

    def stall_suspects(self) -> list[dict]:
        """The engine core process and its tensor-parallel ranks, those that cannot run."""
        return held_processes([("the engine core process", None, self.process.pid)]
                              + [(f"tensor-parallel rank {i}", i, pid) for i, pid in enumerate(self.worker_pids)])

    def start(self, post: Callable[[object], None]) -> None:
        self._post = post
        self._receiver = threading.Thread(target=self._receive, name="pagedserve-core-receiver", daemon=True)
        self._receiver.start()

    def is_alive(self) -> bool:
        return self.process.is_alive() and self._receiver is not None and self._receiver.is_alive()

    def death_reason(self) -> str | None:
        """Why the core is gone: its own last word, or how its process ended, also before the
        receiver thread noticed (None while it runs, or after a shutdown)."""
        if self._death is not None:
            return str(self._death)
        if self._closing or self._receiver is None or self.process.is_alive():
            return None
        return f"{self.describe()} died: {_describe_exit(self.process.exitcode)}"

    def _died(self, error: EngineCoreDied) -> None:
        self._death = error
        self._post(error)

    def _send(self, msg) -> None:
        """Non-blocking: a PUSH socket whose peer is gone would block forever (and with it the
        event loop, or the shutdown)."""
        import zmq

        payload = ENCODER.encode(msg)
        with self._send_lock:
            if self._closing:
                return
            try:
                self._in.send(payload, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise EngineCoreDied(f"{self.describe()} does not take messages (it is gone)") from None

    def add_requests(self, requests: list[Request]) -> None:
        self._num_sent += len(requests)
        self._send(AddMsg([EngineCoreRequest.of(r) for r in requests]))

    def finish_requests(self, request_ids: list[str], status: RequestStatus, stop_reason=None) -> None:
        self._send(FinishMsg(list(request_ids), status, stop_reason))

    def _receive(self) -> None:
        """Outputs in, until the core says it is dead or its process is gone."""
        import zmq

        while not self._closing:
            try:
                ready = self._out.poll(int(RECV_POLL_SECONDS * 1000), zmq.POLLIN)
            except zmq.ZMQError:
                return
            if ready:
                msg = FROM_CORE_DECODER.decode(self._out.recv())
                if isinstance(msg, OutputsMsg):
                    self._num_received = msg.num_received
                    self._post(msg.outputs)
                elif isinstance(msg, DeadMsg):
                    self._died(EngineCoreDied(msg.error))
                    return
            elif not self.process.is_alive() and not self._closing:
                self.process.join(1)
                self._died(EngineCoreDied(f"the engine core process (pid {self.process.pid}) died: "
                                          f"{_describe_exit(self.process.exitcode)}"))
                return

    def shutdown(self, timeout: float = 15.0) -> None:
        if self._closing:
            return
        try:
            self._send(ShutdownMsg())
        except Exception:  # noqa: BLE001 - the core is gone already
            pass
        self._closing = True
        self._stop_process(timeout)
        if self._receiver is not None:
            self._receiver.join(2 * RECV_POLL_SECONDS + 1)
        self._close_sockets()

    def _stop_process(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine core process did not stop in %.0f s; terminating it", timeout)
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def _close_sockets(self) -> None:
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        for path in self._paths:
            try:
                os.unlink(path)
            except OSError:
                pass


def _describe_exit(exitcode: int | None) -> str:
    from pagedserve.worker.multiproc_executor import describe_exit
    return describe_exit(exitcode)
