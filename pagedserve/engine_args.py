"""Engine knobs as command-line flags, named as vLLM names them, shared by every subcommand
that starts an engine (serve, generate, bench-offline...). `--config FILE.yaml` takes the
same keys (dashes or underscores)."""
from __future__ import annotations

import argparse

import yaml

from pagedserve.config import (DEVICES, DTYPES, EXECUTOR_BACKENDS, KV_CACHE_DTYPES, PREEMPTION_MODES,
                               SCHEDULING_POLICIES, EngineConfig)

_FLAGS: list[tuple[str, dict]] = [
    ("--model", dict(default=None, help="local HF checkpoint directory (default: the built-in model)")),
    ("--tokenizer", dict(default=None)),
    ("--dtype", dict(choices=DTYPES, default=None)),
    ("--kv-cache-dtype", dict(choices=KV_CACHE_DTYPES, default=None,
                              help="how the KV cache stores K/V: auto = --dtype; fp8 (= fp8_e4m3), fp8_e5m2 "
                                   "(1 byte, one scale per layer); int8 (1 byte + a scale per token and head)")),
    ("--device", dict(choices=DEVICES, default=None)),
    ("--seed", dict(type=int, default=None)),
    ("--block-size", dict(type=int, default=None)),
    ("--max-num-seqs", dict(type=int, default=None)),
    ("--max-num-batched-tokens", dict(type=int, default=None)),
    ("--max-model-len", dict(type=int, default=None)),
    ("--enable-chunked-prefill", dict(action=argparse.BooleanOptionalAction, default=None)),
    ("--long-prefill-token-threshold", dict(type=int, default=None)),
    ("--kv-cache-memory", dict(default=None, help="KV pool size on CPU, e.g. 4GiB")),
    ("--num-kv-blocks", dict(type=int, default=None, help="exact KV pool size in blocks (overrides memory)")),
    ("--gpu-memory-utilization", dict(type=float, default=None)),
    ("--preemption-mode", dict(choices=PREEMPTION_MODES, default=None)),
    ("--swap-space", dict(default=None, help="host swap pool, e.g. 4GiB")),
    ("--kv-offloading-size", dict(type=float, default=None,
                                  help="GiB of host memory (over all ranks) for a KV tier that keeps prefix "
                                       "blocks the pool evicts and loads them back on a hit")),
    ("--kv-offloading-disk", dict(default=None,
                                  help="a directory for a disk KV tier below the host tier (kept across restarts)")),
    ("--kv-offloading-disk-size", dict(type=float, default=None,
                                       help="GiB of disk (over all ranks) for the --kv-offloading-disk tier")),
    ("--kv-offloading-backend", dict(choices=("native",), default=None, help="the tier's backend (vLLM's flag)")),
    ("--enable-prefix-caching", dict(action=argparse.BooleanOptionalAction, default=None)),
    ("--scheduling-policy", dict(choices=SCHEDULING_POLICIES, default=None)),
    ("--max-logprobs", dict(type=int, default=None)),
    ("--served-model-name", dict(default=None)),
    ("--structured-outputs-cache-bytes", dict(default=None, help="bound on the compiled-grammar cache, by "
                                              "estimated size, e.g. 64MiB (it also keeps at most 256 grammars)")),
    ("--kv-events-config", dict(default=None, help="KV events as vLLM publishes them, JSON: "
                                "{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://127.0.0.1:5557\", "
                                "\"replay_endpoint\": ..., \"topic\": ...} (docs/metrics.md: KV events)")),
    ("--step-trace-path", dict(default=None, help="write one JSON line per engine step (for sim calibrate)")),
    (("--tensor-parallel-size", "-tp", "--tp"), dict(type=int, default=None,
                                                      help="ranks the model is sharded over (one process each)")),
    ("--enable-expert-parallel", dict(action="store_true", default=None,
                                      help="MoE: each rank holds whole experts (E / tp of them) instead of a "
                                           "1/tp slice of every expert")),
    (("--pipeline-parallel-size", "-pp", "--pp"), dict(type=int, default=None,
                                                        help="stages the layers are split into (one process "
                                                             "each, times -tp)")),
    (("--data-parallel-size", "-dp", "--dp"), dict(type=int, default=None,
                                                    help="engine cores in this server, each its own process, "
                                                         "scheduler and KV pool, behind a load balancer; with "
                                                         "--enable-expert-parallel on an MoE model the experts "
                                                         "are spread over them (DP attention + EP)")),
    ("--distributed-executor-backend", dict(choices=EXECUTOR_BACKENDS, default=None,
                                            help="how ranks run: uni (in the engine process, tp=1), mp (one "
                                                 "process per rank, the default for tp > 1), ray (Ray actors)")),
]


def _names(flag: str | tuple[str, ...]) -> tuple[str, ...]:
    return (flag,) if isinstance(flag, str) else flag


def _dest(flag: str | tuple[str, ...]) -> str:
    return _names(flag)[0][2:].replace("-", "_")


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """`skip`: knobs the command defines itself (simulate's -pp: the simulated stages)."""
    group = parser.add_argument_group("engine")
    for flag, kwargs in _FLAGS:
        if _dest(flag) not in skip:
            group.add_argument(*_names(flag), dest=_dest(flag), **kwargs)
    parser.add_argument("--config", default=None, help="YAML file with the same keys as the flags")


# Keys a `serve` YAML file may hold besides the engine's knobs: the server's own settings, read
# by server/cli.server_settings (whose defaults table has exactly these keys; a test checks it).
SERVER_KEYS = frozenset({
    "host", "port", "api_key", "max_queue_len", "max_request_bytes", "max_seqs_per_request",
    "step_watchdog_timeout", "enable_prompt_tokens_details", "enable_auto_tool_choice", "tool_call_parser",
    "dashboard", "shutdown_timeout", "header_read_timeout", "body_read_timeout", "metric_names",
    "replicas", "router", "autoscale",
})


def _config_file_knobs(args: argparse.Namespace) -> dict:
    """The --config YAML file's engine knobs by name (server keys skipped); {} without one.
    Raises ValueError naming the file for anything else in it."""
    values: dict = {}
    if getattr(args, "config", None):
        with open(args.config) as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config: {args.config} must hold a mapping of knob: value")
        known = set(EngineConfig.knob_names())
        for key, value in loaded.items():
            name = key.replace("-", "_")
            if name in known:
                values[name] = value
            elif name not in SERVER_KEYS:
                raise ValueError(f"config: unknown key {key!r} in {args.config}")
    return values


def knob_given(args: argparse.Namespace, name: str) -> bool:
    """Whether the user set knob `name` (by its flag or in the --config file)."""
    return getattr(args, name, None) is not None or name in _config_file_knobs(args)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Flags override the YAML file, which overrides defaults. Raises ValueError naming the knob."""
    values = _config_file_knobs(args)
    for flag, _ in _FLAGS:
        name = _dest(flag)
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    return EngineConfig(**values)
