"""The seam between a front-end (AsyncLLM) and its engine core: one CoreClient protocol, two
ways to run the one engine-core loop (engine/core_loop.py):

    ThreadCoreClient    the loop on a thread of this process, fed through an in-memory inbox
    ProcessCoreClient   the loop in an engine-core process (engine/core_proc.py), fed over
                        ZMQ: the same wire messages (engine/core_wire.py), msgspec-encoded

Both hand every step's EngineCoreOutputs, every pool snapshot a watcher asked for (a
PoolSnapshot), and a fatal error as an exception, to `post` (called from a thread of theirs;
AsyncLLM moves it onto its event loop). Neither waits for the event loop: the core steps while
the loop detokenizes. The front-end sends plain data (EngineCoreRequest: ids, prompt token
ids, SamplingParams, eos ids, arrival, priority) and keeps everything textual on its side.

Faults in the process client: a core that fails sends the error (naming a dead rank, if
that was the cause) and exits 1; a core that vanishes (SIGKILL) is noticed by its process
sentinel within RECV_POLL_SECONDS. Either way `post` gets an EngineCoreDied.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import uuid
from typing import Callable, Protocol

import torch.multiprocessing as torch_mp
import zmq

from pagedserve.core.outputs import EngineCoreOutputs
from pagedserve.core.request import EngineCoreRequest, Request, RequestStatus
from pagedserve.engine.core_loop import CoreLoop, Inbox, pool_layout
from pagedserve.engine.core_proc import run_engine_core
from pagedserve.engine.core_wire import (ENCODER, FROM_CORE_DECODER, AddMsg, DeadMsg, FinishMsg, OutputsMsg, PauseMsg,
                                         PoolLayout, ReadyMsg, ResumeMsg, ShutdownMsg, SnapshotMsg, WatchPoolMsg)
from pagedserve.worker.multiproc_executor import describe_exit

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


class CoreClient(Protocol):
    """What AsyncLLM needs of an engine core, wherever it runs."""

    engine_core: object | None  # the EngineCore when it steps in this process, else None

    @property
    def num_pending_adds(self) -> int:
        """Requests sent that the core has not taken in yet."""

    def start(self, post: Callable[[object], None]) -> None: ...
    def add_requests(self, requests: list[Request]) -> None: ...
    def finish_requests(self, request_ids: list[str], status: RequestStatus, stop_reason=None) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def watch_pool(self, watchers: int, max_rate: float, max_share: float) -> None: ...
    def initial_snapshot(self) -> EngineCoreOutputs: ...
    def pool_layout(self) -> PoolLayout: ...
    def describe(self) -> str: ...
    def stall_suspects(self) -> list[dict]: ...
    def is_alive(self) -> bool: ...
    def death_reason(self) -> str | None: ...
    def shutdown(self, timeout: float = 10.0) -> None: ...


# -- in a thread -----------------------------------------------------------------------
class ThreadCoreClient:
    """The engine-core loop on a thread of this process. Only that thread touches the core."""

    def __init__(self, engine_core, idle_wait: float = 0.25) -> None:
        self.engine_core = engine_core
        self.inbox = Inbox()
        self.loop = CoreLoop(engine_core, self.inbox, self._emit, idle_wait)
        self._num_sent = 0
        self._num_received = 0
        self._thread: threading.Thread | None = None
        self._post: Callable[[object], None] | None = None
        self._death: BaseException | None = None

    def initial_snapshot(self) -> EngineCoreOutputs:
        return self.engine_core.snapshot()

    def pool_layout(self) -> PoolLayout:
        return pool_layout(self.engine_core)

    @property
    def num_pending_adds(self) -> int:
        return max(0, self._num_sent - self._num_received)

    def describe(self) -> str:
        return "the engine thread"

    def stall_suspects(self) -> list[dict]:
        """Processes of this engine that cannot run (its tensor-parallel ranks, if any; the
        engine thread itself is in this process, which is running)."""
        pids = self.engine_core.executor.worker_pids()
        return held_processes([(f"tensor-parallel rank {i}", i, pid) for i, pid in enumerate(pids)])

    def start(self, post: Callable[[object], None]) -> None:
        self._post = post
        self.loop.stopped = False
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
        self._num_sent += len(requests)
        self.inbox.put(AddMsg([EngineCoreRequest.of(r) for r in requests]))

    def finish_requests(self, request_ids: list[str], status: RequestStatus, stop_reason=None) -> None:
        self.inbox.put(FinishMsg(list(request_ids), status, stop_reason))

    def pause(self) -> None:
        self.inbox.put(PauseMsg())

    def resume(self) -> None:
        self.inbox.put(ResumeMsg())

    def watch_pool(self, watchers: int, max_rate: float, max_share: float) -> None:
        self.inbox.put(WatchPoolMsg(watchers, max_rate, max_share))

    def shutdown(self, timeout: float = 10.0) -> None:
        self.loop.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.engine_core.shutdown()

    def _emit(self, msg) -> None:
        if isinstance(msg, OutputsMsg):
            self._num_received = msg.num_received
            self._post(msg.outputs)
        elif isinstance(msg, SnapshotMsg):
            self._post(msg.snapshot)

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as e:  # noqa: BLE001 - fatal, whatever it is: the core's state is unknown
            logger.exception("engine step failed; the engine is dead")
            self._death = e
            self._post(e)


# -- in its own process -----------------------------------------------------------------
class ProcessCoreClient:
    """The engine core in an engine-core process, over two ZMQ IPC sockets (PUSH requests in,
    PULL outputs back). Built synchronously: returns once the core has loaded the model and
    sized its pool, or raises what stopped it (a ValueError for a bad knob)."""

    def __init__(self, settings, start_timeout: float = 900.0, wait: bool = True) -> None:
        """`settings`: the front-end's ResolvedConfig, which the core is built from.
        `wait=False`: return once the process is started; `wait_ready()` then waits for it
        (the data-parallel client starts all its cores before waiting for any: under DP + EP
        they meet in one process group while they start)."""
        self.engine_core = None
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
        spawn = torch_mp.get_context("spawn")
        self.process = spawn.Process(target=run_engine_core, name="pagedserve-engine-core",
                                     args=(settings, f"ipc://{self._paths[0]}",
                                           f"ipc://{self._paths[1]}"), daemon=False)
        self.process.start()
        self._start_timeout = start_timeout
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the core has loaded the model and sized its pool (or raise what stopped it)."""
        try:
            ready = self._wait_ready(self._start_timeout)
        except BaseException:
            self._stop_process(5.0)
            self._close_sockets()
            raise
        self._snapshot = ready.snapshot
        self._layout = ready.layout
        self.worker_pids = list(ready.worker_pids)
        logger.info("engine core process pid %d%s", self.process.pid,
                    f", tensor-parallel ranks {self.worker_pids}" if self.worker_pids else "")

    def _wait_ready(self, timeout: float) -> ReadyMsg:
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
                                     f"{describe_exit(self.process.exitcode)}")
        raise EngineCoreDied(f"the engine core process did not start within {timeout:.0f} s")

    def initial_snapshot(self) -> EngineCoreOutputs:
        return self._snapshot

    def pool_layout(self) -> PoolLayout:
        return self._layout

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
        return f"{self.describe()} died: {describe_exit(self.process.exitcode)}"

    def _died(self, error: EngineCoreDied) -> None:
        self._death = error
        self._post(error)

    def _send(self, msg) -> None:
        """Non-blocking: a PUSH socket whose peer is gone would block forever (and with it the
        event loop, or the shutdown)."""
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

    def pause(self) -> None:
        self._send(PauseMsg())

    def resume(self) -> None:
        self._send(ResumeMsg())

    def watch_pool(self, watchers: int, max_rate: float, max_share: float) -> None:
        self._send(WatchPoolMsg(watchers, max_rate, max_share))

    def _receive(self) -> None:
        """Outputs in, until the core says it is dead or its process is gone."""
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
                elif isinstance(msg, SnapshotMsg):
                    self._post(msg.snapshot)
                elif isinstance(msg, DeadMsg):
                    self._died(EngineCoreDied(msg.error))
                    return
            elif not self.process.is_alive() and not self._closing:
                self.process.join(1)
                self._died(EngineCoreDied(f"the engine core process (pid {self.process.pid}) died: "
                                          f"{describe_exit(self.process.exitcode)}"))
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


