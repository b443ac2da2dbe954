"""`pagedserve serve --replicas N`: the serve command's flags and YAML, read as for one server
(server/cli.py), run as a Ray Serve application of servers (fleet/serve.py). The program's entry
(pagedserve/cli.py) sends a serve with replicas here, since the fleet sits above the server."""
from __future__ import annotations

import os

from pagedserve.engine_args import engine_config_from_args
from pagedserve.server.cli import server_settings


def wants_replicas(args) -> bool:
    settings = server_settings(args)
    return settings["replicas"] is not None or settings["autoscale"] is not None


def run_replicas(args) -> int:
    """`serve --replicas N` / `--autoscale MIN:MAX`: the Ray Serve application (fleet/serve.py) on host:port."""
    from pagedserve.fleet.serve import autoscaling_config, replica_resources, run_fleet

    settings = server_settings(args)
    config = engine_config_from_args(args)

    server_kwargs = {k: settings[k] for k in ("api_key", "max_queue_len", "max_seqs_per_request",
                                               "step_watchdog_timeout", "max_request_bytes", "tool_call_parser",
                                               "shutdown_timeout", "metric_names")}
    server_kwargs.update(enable_prompt_tokens_details=bool(settings["enable_prompt_tokens_details"]),
                         enable_auto_tool_choice=bool(settings["enable_auto_tool_choice"]), dashboard=False)
    replica_resources(config, args.cpus_per_replica)   # what a replica cannot be is refused before Ray starts
    if settings["autoscale"] is not None:  # a bad MIN:MAX is refused before Ray starts
        autoscaling_config(settings["autoscale"], config, settings["replicas"])
    run_fleet(config, settings["replicas"], settings["router"], settings["host"], settings["port"],
              cpus_per_replica=args.cpus_per_replica, server_kwargs=server_kwargs,
              ray_address=os.environ.get("RAY_ADDRESS"), autoscale=settings["autoscale"])
    return 0
