"""The engine-core process: the engine-core loop (engine/core_loop.py) as its main loop,
between two ZMQ sockets.

    input thread:   ZMQ PULL -> decode -> the loop's inbox       (the wire messages to the core)
    main thread:    CoreLoop.run(): apply messages, step while there is work
    output thread:  queue -> encode -> ZMQ PUSH                   (OutputsMsg, SnapshotMsg, DeadMsg)

The loop never waits for the API process: socket I/O and (de)serialization happen in the
two threads, which run while the executor computes (torch releases the GIL).

Ends: ShutdownMsg or SIGTERM (clean: executor shut down, exit 0); a failed step or a dead
rank (the error is sent as DeadMsg, the executor is shut down, exit 1); the API process
gone (PR_SET_PDEATHSIG, and a parent check whenever the loop idles; exit 1).

Benchmarks only: with PAGEDSERVE_COMM_STATS=<prefix> in the environment, the core times its
model's collectives (model/parallel.py CommObserver) and, whenever its loop idles, writes
their running totals and its forward count to <prefix>.dp<data-parallel rank>.json.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading

import zmq

from pagedserve.config import ResolvedConfig
from pagedserve.engine.core_loop import CoreLoop, Inbox, pool_layout
from pagedserve.engine.core_wire import ENCODER, TO_CORE_DECODER, DeadMsg, ReadyMsg
from pagedserve.engine.llm_engine import build_engine_core
from pagedserve.worker.worker import set_parent_death_signal
from pagedserve.utils import freeze_startup_heap

logger = logging.getLogger("pagedserve.engine")

_STOP = object()


def run_engine_core(settings: ResolvedConfig, in_addr: str, out_addr: str) -> None:
    """The engine-core process's body, built from the API process's resolved config (it
    resolves nothing again); a runner here builds its own grammar compiler."""
    set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server shuts us down
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s engine-core %(name)s: %(message)s")
    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.connect(out_addr)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(in_addr)
    try:
        core = build_engine_core(settings, load_grammar_compiler=True)
    except BaseException as e:  # noqa: BLE001 - tell the API process why, then exit
        logger.exception("the engine core failed to start")
        out_sock.send(ENCODER.encode(DeadMsg(f"{e}" if isinstance(e, ValueError) else f"{type(e).__name__}: {e}",
                                             bad_config=isinstance(e, ValueError))))
        out_sock.close(linger=2000)
        ctx.term()
        os._exit(1)
    freeze_startup_heap(f"engine core {settings.config.data_parallel_rank}")
    worker_pids = core.executor.worker_pids()
    out_sock.send(ENCODER.encode(ReadyMsg(core.snapshot(), os.getpid(), worker_pids, pool_layout(core))))
    code = EngineCoreProcess(core, in_sock, out_sock, settings.config.data_parallel_rank).run()  # the I/O threads close their sockets first
    ctx.term()
    os._exit(code)


class EngineCoreProcess:
    """The loop and its two socket threads."""

    def __init__(self, core, in_sock, out_sock, dp_rank: int = 0) -> None:
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.outbox: queue.Queue = queue.Queue()
        self._parent = os.getppid()
        self.loop = CoreLoop(core, Inbox(), self.outbox.put, on_idle=self._on_idle)
        self._comm_stats = _CommStats.from_env(core, dp_rank)
        signal.signal(signal.SIGTERM, lambda *_: self.loop.request_stop())

    def run(self) -> int:
        reader = threading.Thread(target=self._read, name="core-input", daemon=True)
        writer = threading.Thread(target=self._write, name="core-output", daemon=True)
        reader.start()
        writer.start()
        code = 0
        try:
            self.loop.run()
        except BaseException as e:  # noqa: BLE001 - fatal, whatever it is: report it, whoever caused it
            logger.exception("engine core failed; the engine is dead")
            self.outbox.put(DeadMsg(f"{type(e).__name__}: {e}"))
            code = 1
        self.loop.stopped = True
        self.outbox.put(_STOP)
        writer.join(5)
        reader.join(1)
        self.core.shutdown()
        return code

    def _on_idle(self) -> None:
        self._check_parent()
        if self._comm_stats is not None:
            self._comm_stats.write()

    def _check_parent(self) -> None:
        if os.getppid() != self._parent:
            raise RuntimeError("the API process is gone")

    def _read(self) -> None:
        """Owns the input socket: decode each message onto the loop's inbox until it stops."""
        try:
            while not self.loop.stopped:
                if self.in_sock.poll(100, zmq.POLLIN):
                    self.loop.inbox.put(TO_CORE_DECODER.decode(self.in_sock.recv()))
        finally:
            self.in_sock.close(linger=0)

    def _write(self) -> None:
        """Owns the output socket: encode and send each message until _STOP."""
        try:
            while (msg := self.outbox.get()) is not _STOP:
                self.out_sock.send(ENCODER.encode(msg), copy=False)
        finally:
            self.out_sock.close(linger=2000)


class _CommStats:
    """PAGEDSERVE_COMM_STATS (benchmarks): this core's collectives, written out when it idles."""

    def __init__(self, core, path: str) -> None:
        from pagedserve.model.parallel import CommObserver, set_comm_observer

        self.core, self.path = core, path
        self.observer = CommObserver()
        set_comm_observer(self.observer)
        self._written = None

    @classmethod
    def from_env(cls, core, dp_rank: int) -> "_CommStats | None":
        prefix = os.environ.get("PAGEDSERVE_COMM_STATS")
        return cls(core, f"{prefix}.dp{dp_rank}.json") if prefix else None

    def write(self) -> None:
        import json

        state = {"comm": self.observer.summary(), "num_forwards": getattr(self.core.executor, "num_forwards", 0)}
        if state != self._written:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, self.path)
            self._written = state
