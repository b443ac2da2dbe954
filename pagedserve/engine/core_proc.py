"""The engine-core process: a busy loop that owns the EngineCore (scheduler + executor).

    input thread:   ZMQ PULL -> decode -> queue          (AddMsg, FinishMsg, ShutdownMsg)
    main loop:      apply every queued message, then core.step() while there is work;
                    idle: block on the queue (so gauges still refresh every IDLE_WAIT)
    output thread:  queue -> encode -> ZMQ PUSH           (OutputsMsg per step)

The loop never waits for the API process: socket I/O and (de)serialization happen in the
two threads, which run while the executor computes (torch releases the GIL). Messages
apply before the next step, so an abort frees its blocks before that step.

Ends: ShutdownMsg or SIGTERM (clean: executor shut down, exit 0); a failed step or a dead
rank (the error is sent as DeadMsg, the executor is shut down, exit 1); the API process
gone (PR_SET_PDEATHSIG, and a parent check each iteration; exit 1).
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading

from pagedserve.core.request import EngineCoreRequest

logger = logging.getLogger("pagedserve.engine")

IDLE_WAIT = 0.25


def run_engine_core(config, eos_token_ids: list[int], in_addr: str, out_addr: str) -> None:
    from pagedserve.worker.worker import set_parent_death_signal

    set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server shuts us down
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s engine-core %(name)s: %(message)s")
    import zmq

    from pagedserve.engine.core_wire import ENCODER, DeadMsg, ReadyMsg

    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.connect(out_addr)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(in_addr)
    try:
        core = _build_core(config, frozenset(eos_token_ids))
    except BaseException as e:  # noqa: BLE001 - tell the API process why, then exit
        logger.exception("the engine core failed to start")
        out_sock.send(ENCODER.encode(DeadMsg(f"{e}" if isinstance(e, ValueError) else f"{type(e).__name__}: {e}",
                                             bad_config=isinstance(e, ValueError))))
        out_sock.close(linger=2000)
        ctx.term()
        os._exit(1)
    worker_pids = list(getattr(core.executor, "pids", []))
    out_sock.send(ENCODER.encode(ReadyMsg(core.snapshot(), os.getpid(), worker_pids)))
    loop = EngineCoreLoop(core, in_sock, out_sock)
    signal.signal(signal.SIGTERM, lambda *_: loop.request_stop())
    code = loop.run()  # the reader and writer threads close their sockets before it returns
    ctx.term()
    os._exit(code)


def _build_core(config, eos_token_ids: frozenset[int]):
    from pagedserve.config import resolve_dtype
    from pagedserve.engine.llm_engine import build_engine_core
    from pagedserve.structured.compiler import make_grammar_compiler
    from pagedserve.tokenizer import load_tokenizer
    from pagedserve.model.config import read_model_config

    model_config = read_model_config(config.model)
    dtype = resolve_dtype(config.dtype, model_config.checkpoint_dtype, config.device)
    grammar_compiler = None
    if config.distributed_executor_backend == "uni":  # the model runs here; ranks build their own
        grammar_compiler = make_grammar_compiler(load_tokenizer(config), model_config.vocab_size, eos_token_ids,
                                                 config.structured_outputs_cache_bytes)
    return build_engine_core(config, model_config, dtype, eos_token_ids, grammar_compiler=grammar_compiler)


_STOP = object()


class EngineCoreLoop:
    def __init__(self, core, in_sock, out_sock) -> None:
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.num_received = 0
        self._stop = False
        self._parent = os.getppid()

    def request_stop(self) -> None:
        self._stop = True
        self.inbox.put(_STOP)

    def run(self) -> int:
        from pagedserve.engine.core_wire import DeadMsg

        reader = threading.Thread(target=self._read, name="core-input", daemon=True)
        writer = threading.Thread(target=self._write, name="core-output", daemon=True)
        reader.start()
        writer.start()
        code = 0
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - fatal, whatever it is: report it, whoever caused it
            logger.exception("engine core failed; the engine is dead")
            self.outbox.put(DeadMsg(f"{type(e).__name__}: {e}"))
            code = 1
        self._stop = True
        self.outbox.put(_STOP)
        writer.join(5)
        reader.join(1)
        self.core.shutdown()
        return code

    def _loop(self) -> None:
        from pagedserve.engine.core_wire import OutputsMsg

        core = self.core
        check_health = getattr(core.executor, "check_health", None)
        while not self._stop:
            if not core.has_unfinished_requests():
                try:
                    self._handle(self.inbox.get(timeout=IDLE_WAIT))
                except queue.Empty:
                    self._check_parent()
                    self._emit(OutputsMsg(core.observe(core.snapshot()), self.num_received))
                    if check_health is not None:
                        check_health()
                    continue
            while True:
                try:
                    self._handle(self.inbox.get_nowait())
                except queue.Empty:
                    break
            if self._stop:
                return
            if check_health is not None:
                check_health()
            if core.has_unfinished_requests():
                self._emit(OutputsMsg(core.observe(core.step()), self.num_received))

    def _check_parent(self) -> None:
        if os.getppid() != self._parent:
            raise RuntimeError("the API process is gone")

    def _handle(self, msg) -> None:
        from pagedserve.engine.core_wire import AddMsg, FinishMsg

        if msg is _STOP:
            self._stop = True
        elif isinstance(msg, AddMsg):
            for data in msg.requests:
                self.core.add_request(EngineCoreRequest.to_request(data))
            self.num_received += len(msg.requests)
        elif isinstance(msg, FinishMsg):
            self.core.finish_requests(msg.request_ids, msg.status, msg.stop_reason)
        else:  # ShutdownMsg
            self._stop = True

    def _emit(self, msg) -> None:
        self.outbox.put(msg)

    def _read(self) -> None:
        """Owns the input socket: decode each message onto the inbox until the loop stops."""
        import zmq

        from pagedserve.engine.core_wire import TO_CORE_DECODER
        try:
            while not self._stop:
                if self.in_sock.poll(100, zmq.POLLIN):
                    self.inbox.put(TO_CORE_DECODER.decode(self.in_sock.recv()))
        finally:
            self.in_sock.close(linger=0)

    def _write(self) -> None:
        """Owns the output socket: encode and send each message until _STOP."""
        from pagedserve.engine.core_wire import ENCODER
        try:
            while (msg := self.outbox.get()) is not _STOP:
                self.out_sock.send(ENCODER.encode(msg), copy=False)
        finally:
            self.out_sock.close(linger=2000)
