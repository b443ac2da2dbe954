"""Build a server from an EngineConfig, and run uvicorn in a background thread (tests, notebooks)."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn

from pagedserve.config import EngineConfig
from pagedserve.metrics import EngineMetrics
from pagedserve.server.app import build_app
from pagedserve.engine.async_llm import AsyncLLM


ENGINE_CORE_MODES = ("auto", "thread", "process")


def resolve_engine_core_mode(mode: str, device: str) -> str:
    """auto: its own process, on CUDA (the GPU must never wait on the GIL) and on CPU, where it
    was the faster of the two on an otherwise idle machine (docs/scaling.md)."""
    if mode not in ENGINE_CORE_MODES:
        raise ValueError(f"engine_core_mode: must be one of {ENGINE_CORE_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    return "process" if device == "cuda" else CPU_DEFAULT_ENGINE_CORE_MODE


CPU_DEFAULT_ENGINE_CORE_MODE = "process"

# Admission bounds, in sequences (a request of p prompts with n samples is p x n of them).
# One request may hold at most two default batches (max_num_seqs 128): enough for any batch a
# client means to run together, not thousands queued ahead of everyone else.
DEFAULT_MAX_SEQS_PER_REQUEST = 256
# The waiting queue: eight batches' worth, at least 1,024. A sequence queued past it would wait
# for eight whole generations before it starts; a 503 lets the client or the load balancer go
# elsewhere instead.
QUEUE_BATCHES = 8
MIN_DEFAULT_MAX_QUEUE_LEN = 1024


def resolve_admission(config: EngineConfig, max_queue_len: int | None,
                      max_seqs_per_request: int | None) -> tuple[int | None, int | None]:
    """(waiting-queue bound, sequences-per-request bound), None = no limit. Given as None: the
    defaults above; given as 0: no limit."""
    if max_seqs_per_request is None:
        max_seqs_per_request = DEFAULT_MAX_SEQS_PER_REQUEST
    if max_queue_len is None:
        max_queue_len = max(MIN_DEFAULT_MAX_QUEUE_LEN, QUEUE_BATCHES * config.max_num_seqs, max_seqs_per_request)
    return max_queue_len or None, max_seqs_per_request or None


def build_server(config: EngineConfig, api_key: str | None = None, max_queue_len: int | None = None,
                 log_interval: float = 10.0, max_request_bytes: int | None = None,
                 enable_prompt_tokens_details: bool = False, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, engine_core_mode: str = "thread",
                 dashboard: bool = True, max_seqs_per_request: int | None = None,
                 step_watchdog_timeout: float | None = None,
                 shutdown_timeout: float | None = None, metric_names: str = "pagedserve"):
    """(app, async_engine). engine_core_mode: "thread" (the core steps in a thread of this
    process, from an Engine), "process" (an engine-core process, started and ready before
    this returns), or "auto". The core's side starts with the app. `max_queue_len` and
    `max_seqs_per_request`: None = the defaults (resolve_admission), 0 = no limit.
    `step_watchdog_timeout`: see AsyncLLM (None = derived from measured steps, 0 = off).
    `metric_names`: pagedserve | vllm | both (metrics.METRIC_NAMINGS)."""
    max_queue_len, max_seqs_per_request = resolve_admission(config, max_queue_len, max_seqs_per_request)
    from pagedserve.engine.core_client import ProcessCoreClient, ThreadCoreClient
    from pagedserve.engine.llm_engine import Engine, EngineFrontend

    # The front-end resolves the config once (engine/resolve.py); the core, in this process or
    # its own, is built from those settings, and everything below reads them.
    dp_client = None
    if config.data_parallel_size > 1:  # each data-parallel core is its own process, whatever the mode says
        from pagedserve.engine.dp_client import DPCoreClient

        engine = EngineFrontend(config)
        client = dp_client = DPCoreClient(engine.settings)
    elif resolve_engine_core_mode(engine_core_mode, config.device) == "process":
        engine = EngineFrontend(config)
        client = ProcessCoreClient(engine.settings)
    else:
        engine = Engine(config)
        client = ThreadCoreClient(engine.engine_core)
    settings = engine.settings
    metrics = EngineMetrics(engine.model_name, settings.config.max_model_len, log_interval=log_interval,
                            max_num_batched_tokens=settings.config.max_num_batched_tokens, names=metric_names)
    layout = client.pool_layout()  # the pool as the core sized it
    metrics.set_cache_config(settings.kv_cache_dtype, layout.block_size, layout.num_blocks, layout.bytes_per_token,
                             settings.config.device)
    if engine.grammar_compiler is not None:
        metrics.watch_grammar_cache(engine.grammar_compiler)
    if dp_client is not None:  # the data-parallel client's per-engine gauges
        dp_client.metrics = metrics
    async_engine = AsyncLLM(engine, metrics, max_queue_len=max_queue_len, client=client,
                            step_watchdog_timeout=step_watchdog_timeout)
    return build_app(async_engine, api_key=api_key, max_request_bytes=max_request_bytes,
                     max_seqs_per_request=max_seqs_per_request,
                     enable_prompt_tokens_details=enable_prompt_tokens_details,
                     enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                     dashboard=dashboard, shutdown_timeout=shutdown_timeout), async_engine


class ServerThread:
    """uvicorn serving `app` on host:port (port 0 = a free one) in a daemon thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 header_read_timeout: float | None = None, body_read_timeout: float | None = None) -> None:
        """Read timeouts as `pagedserve serve`'s flags (server/read_timeouts.py; None = default, 0 = off)."""
        from pagedserve.server.read_timeouts import (DEFAULT_BODY_READ_TIMEOUT, DEFAULT_HEADER_READ_TIMEOUT,
                                                     protocol_with_read_timeouts)

        self.app = app
        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        protocol = protocol_with_read_timeouts(
            DEFAULT_HEADER_READ_TIMEOUT if header_read_timeout is None else header_read_timeout,
            DEFAULT_BODY_READ_TIMEOUT if body_read_timeout is None else body_read_timeout)
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5, http=protocol)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="pagedserve-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
