"""`pagedserve serve`: every engine knob as a vLLM-named flag, plus the server's own."""
from __future__ import annotations

import logging
import os

import yaml

from pagedserve.structured.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("pagedserve.server")

_SERVER_DEFAULTS = {"host": "127.0.0.1", "port": 8000, "api_key": None, "max_queue_len": None,
                    "max_request_bytes": None, "enable_prompt_tokens_details": False,
                    "enable_auto_tool_choice": False, "tool_call_parser": None}


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
                        help="reject new requests with 503 + Retry-After while this many wait (default: no limit)")
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
    server.add_argument("--log-interval", type=float, default=10.0,
                        help="seconds between stats log lines (0 = off)")
    server.add_argument("--uvicorn-log-level", default="info")
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
    port, queue, size = settings["port"], settings["max_queue_len"], settings["max_request_bytes"]
    if size is not None and (not isinstance(size, int) or size < 0):
        raise ValueError(f"max_request_bytes: must be an integer >= 0 (0 = no limit), got {size!r}")
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port: must be an integer in [0, 65535], got {port!r}")
    if queue is not None and (not isinstance(queue, int) or queue < 0):
        raise ValueError(f"max_queue_len: must be an integer >= 0, got {queue!r}")
    parser = settings["tool_call_parser"]
    if parser is not None and parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {parser!r}; choose from {sorted(TOOL_PARSERS)}")
    if settings["enable_auto_tool_choice"] and parser is None:
        raise ValueError("enable_auto_tool_choice: needs --tool-call-parser (hermes or llama3_json)")
    return settings


def run(args) -> int:
    import uvicorn

    from pagedserve.engine_args import engine_config_from_args
    from pagedserve.server.launcher import build_server

    settings = server_settings(args)
    config = engine_config_from_args(args)
    app, async_engine = build_server(config, api_key=settings["api_key"],
                                     max_queue_len=settings["max_queue_len"], log_interval=args.log_interval,
                                     max_request_bytes=settings["max_request_bytes"],
                                     enable_prompt_tokens_details=bool(settings["enable_prompt_tokens_details"]),
                                     enable_auto_tool_choice=bool(settings["enable_auto_tool_choice"]),
                                     tool_call_parser=settings["tool_call_parser"])
    logger.info("serving %s on http://%s:%d", async_engine.engine.model_name, settings["host"], settings["port"])
    uvicorn.run(app, host=settings["host"], port=settings["port"], log_level=args.uvicorn_log_level)
    return 0
