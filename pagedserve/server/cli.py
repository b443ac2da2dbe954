"""`pagedserve serve`: every engine knob as a vLLM-named flag, plus the server's own."""
from __future__ import annotations

import argparse
import logging
import os

import yaml

from pagedserve.structured.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("pagedserve.server")

_SERVER_DEFAULTS = {"host": "127.0.0.1", "port": 8000, "api_key": None, "max_queue_len": None,
                    "max_seqs_per_request": None, "step_watchdog_timeout": None,
                    "max_request_bytes": None, "enable_prompt_tokens_details": False,
                    "enable_auto_tool_choice": False, "tool_call_parser": None, "dashboard": True,
                    "shutdown_timeout": None, "header_read_timeout": None, "body_read_timeout": None,
                    "metric_names": "pagedserve", "replicas": None, "router": "kv-aware",
                    "autoscale": None}
# Settings checked alike: counts where 0 = no limit, and seconds (with what 0 means, where it is not "none").
_COUNT_LIMITS = ("max_request_bytes", "max_queue_len", "max_seqs_per_request")
_SECONDS = {"step_watchdog_timeout": " (0 = off)", "shutdown_timeout": "", "header_read_timeout": "",
            "body_read_timeout": ""}


def register(sub) -> None:
    from pagedserve.engine_args import add_engine_args

    p = sub.add_parser("serve", help="serve the OpenAI-compatible API over HTTP",
                       description="Serve the OpenAI-compatible API (and /metrics) over HTTP. Without --model "
                                   "the built-in default model is served.")
    add_engine_args(p)
    server = p.add_argument_group("server")
    server.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=None, help="port (default 8000)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (or env PAGEDSERVE_API_KEY)")
    server.add_argument("--max-queue-len", type=int, default=None,
                        help="answer 503 + Retry-After to a request whose sequences would take the waiting "
                             "sequences past this (default: max(1024, 8 x max_num_seqs); 0 = no limit)")
    server.add_argument("--max-seqs-per-request", type=int, default=None,
                        help="answer 400 to a request of more sequences (prompts x n) than this "
                             "(default 256; 0 = no limit)")
    server.add_argument("--step-watchdog-timeout", type=float, default=None,
                        help="seconds without a completed engine step, while requests are in flight, before "
                             "/health answers 503 naming the stuck process (default: 10 x the longest step to "
                             "expect, measured: the slowest step seen or a full prefill chunk extrapolated from the "
                             "largest step; at least 10, and 60 until a step was measured; 0 = off)")
    server.add_argument("--max-request-bytes", type=int, default=None,
                        help="answer 413 to a request body larger than this (default: 32 bytes per token of "
                             "max_model_len, at least 1 MiB; 0 = no limit)")
    server.add_argument("--enable-prompt-tokens-details", action="store_true", default=None,
                        help="report usage.prompt_tokens_details.cached_tokens (prompt tokens the prefix cache served)")
    server.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                        help='allow tool_choice "auto" (the default when tools are sent): the model writes calls '
                             "in its own format and --tool-call-parser reads them")
    server.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="how to read a model's tool calls under tool_choice auto: hermes (<tool_call> tags: "
                             "Hermes, Qwen) or llama3_json (Llama 3.x JSON calls)")
    server.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=None,
                        help="serve the live KV-pool dashboard at /dashboard (default on; public like /metrics, "
                             "also with --api-key: it shows request ids and counts, never text)")
    server.add_argument("--shutdown-timeout", type=float, default=None,
                        help="on SIGTERM/SIGINT: seconds the requests in flight get to finish while new ones get "
                             "503 (vLLM's flag; 0 = end them at once, with an error); then the rest end with an "
                             "error and the server exits 0 (default 20)")
    server.add_argument("--header-read-timeout", type=float, default=None,
                        help="seconds a client has to send a request's headers; then 408 and the connection is "
                             "closed (default 10; 0 = no limit)")
    server.add_argument("--body-read-timeout", type=float, default=None,
                        help="seconds a request body may go without a byte arriving; then 408 and the connection "
                             "is closed (default 30; 0 = no limit)")
    server.add_argument("--metric-names", default=None, choices=("pagedserve", "vllm", "both"),
                        help="prefixes on /metrics: pagedserve (default), vllm (vLLM's names and histogram bounds "
                             "for every metric vLLM has, pagedserve:* for the rest: a vLLM fleet's boards, routers "
                             "and autoscalers read it unchanged) or both (docs/metrics.md)")
    fleet = p.add_argument_group("replicas (Ray Serve; docs/replicas.md)")
    fleet.add_argument("--replicas", type=int, default=None,
                       help="run N engine replicas behind one endpoint as a Ray Serve application (needs "
                            "ray[serve]; joins RAY_ADDRESS's cluster, else starts a local Ray)")
    fleet.add_argument("--router", default=None, choices=("round-robin", "power-of-two", "kv-aware"),
                       help="how the replicas share requests (default kv-aware: the replica holding the longest "
                            "cached prefix, from its KV events, within a bounded imbalance)")
    fleet.add_argument("--autoscale", default=None, metavar="MIN:MAX[:TARGET]",
                       help="let Ray Serve scale the replicas between MIN and MAX on queue length: TARGET ongoing "
                            "requests per replica (default the engine's max_num_seqs); --replicas, if given, is "
                            "the start")
    fleet.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs per rank of a replica's engine (default 1; a -tp 2 replica takes 2)")
    server.add_argument("--log-interval", type=float, default=10.0,
                        help="seconds between stats log lines (0 = off)")
    server.add_argument("--uvicorn-log-level", default="info")
    server.add_argument("--engine-core-mode", choices=("auto", "thread", "process"), default="auto",
                        help="where the engine core (scheduler + executor) runs: a thread of the API process, "
                             "or its own process fed over ZMQ; auto = process on CUDA, and on CPU the one "
                             "measured faster (see README, Scaling out)")
    p.set_defaults(func=run)


def server_settings(args) -> dict:
    """Flags override the YAML file (same keys), which overrides the defaults."""
    settings = dict(_SERVER_DEFAULTS)
    if getattr(args, "config", None):
        with open(args.config) as f:
            loaded = yaml.safe_load(f) or {}
        for key, value in loaded.items():
            name = str(key).replace("-", "_")
            if name in settings:
                settings[name] = value
    for name in settings:
        value = getattr(args, name, None)
        if value is not None:
            settings[name] = value
    if settings["api_key"] is None:
        settings["api_key"] = os.environ.get("PAGEDSERVE_API_KEY") or None
    port = settings["port"]
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port: must be an integer in [0, 65535], got {port!r}")
    if not isinstance(settings["dashboard"], bool):
        raise ValueError(f"dashboard: must be true or false, got {settings['dashboard']!r}")
    for name in _COUNT_LIMITS:
        value = settings[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name}: must be an integer >= 0 (0 = no limit), got {value!r}")
    for name, zero in _SECONDS.items():
        value = settings[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{name}: must be a number of seconds >= 0{zero}, got {value!r}")
    replicas = settings["replicas"]
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        raise ValueError(f"replicas: must be an integer >= 1, got {replicas!r}")
    if settings["router"] not in ("round-robin", "power-of-two", "kv-aware"):
        raise ValueError(f"router: must be round-robin, power-of-two or kv-aware, got {settings['router']!r}")
    if settings["metric_names"] not in ("pagedserve", "vllm", "both"):
        raise ValueError(f"metric_names: must be pagedserve, vllm or both, got {settings['metric_names']!r}")
    parser = settings["tool_call_parser"]
    if parser is not None and parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {parser!r}; choose from {sorted(TOOL_PARSERS)}")
    if settings["enable_auto_tool_choice"] and parser is None:
        raise ValueError("enable_auto_tool_choice: needs --tool-call-parser (hermes or llama3_json)")
    return settings


# After the engine dies the server answers 503 for this long (so health probes and load
# balancers see why), then exits non-zero.
EXIT_AFTER_ENGINE_DEATH_SECONDS = 2.0


def run(args) -> int:
    import asyncio

    from pagedserve.engine_args import engine_config_from_args
    from pagedserve.server.http_server import make_server
    from pagedserve.server.launcher import build_server
    from pagedserve.utils import freeze_startup_heap

    settings = server_settings(args)
    config = engine_config_from_args(args)
    if settings["replicas"] is not None or settings["autoscale"] is not None:  # pagedserve/cli.py: fleet/cli.py
        raise ValueError("replicas: `pagedserve serve --replicas N` runs the Ray Serve application (fleet/cli.py), "
                         "not one server")
    app, async_engine = build_server(config, api_key=settings["api_key"],
                                     max_queue_len=settings["max_queue_len"], log_interval=args.log_interval,
                                     max_seqs_per_request=settings["max_seqs_per_request"],
                                     step_watchdog_timeout=settings["step_watchdog_timeout"],
                                     max_request_bytes=settings["max_request_bytes"],
                                     enable_prompt_tokens_details=bool(settings["enable_prompt_tokens_details"]),
                                     enable_auto_tool_choice=bool(settings["enable_auto_tool_choice"]),
                                     tool_call_parser=settings["tool_call_parser"],
                                     engine_core_mode=getattr(args, "engine_core_mode", "auto"),
                                     dashboard=settings["dashboard"], shutdown_timeout=settings["shutdown_timeout"],
                                     metric_names=settings["metric_names"])
    server = make_server(app, settings["host"], settings["port"], args.uvicorn_log_level,
                         header_read_timeout=settings["header_read_timeout"],
                         body_read_timeout=settings["body_read_timeout"])

    def exit_soon(error: BaseException) -> None:
        logger.error("the engine is dead (%s: %s); the server exits in %.0f s", type(error).__name__, error,
                     EXIT_AFTER_ENGINE_DEATH_SECONDS)
        asyncio.get_running_loop().call_later(EXIT_AFTER_ENGINE_DEATH_SECONDS, setattr, server, "should_exit", True)

    async_engine.on_dead.append(exit_soon)
    logger.info("serving %s on http://%s:%d", async_engine.engine.model_name, settings["host"], settings["port"])
    if getattr(app.state, "dashboard", None) is not None:
        logger.info("dashboard: http://%s:%d/dashboard", settings["host"], settings["port"])
    freeze_startup_heap("api server")  # utils.py: a full collection here was a ~0.5 s stall
    try:
        server.run()
    finally:
        async_engine.shutdown()  # a no-op if the app's lifespan already did it; never leave a process behind
    if async_engine.dead_error is not None:
        logger.error("exiting with status 1: the engine died: %s", async_engine.dead_error)
        return 1
    return 0
