"""Routers (fleet/routing.py): decisions from scripted KV-event streams, torch-free.

The reference for a prompt's keys is the engine's own pool: after the KV manager caches a
prompt, the pool's cached keys are exactly what the router computes from the token ids."""
from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache import KVCacheManager
from pagedserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from pagedserve.core.request import Request
from pagedserve.fleet.routing import (KVAwareRouter, PowerOfTwoRouter, RoundRobinRouter, make_router,
                                      prompt_block_hashes)
from pagedserve.sampling import SamplingParams

BS = 4


def cache_prompt(tokens: list[int], num_blocks: int = 16) -> tuple[BlockPool, list]:
    """A pool with events, after the KV manager computed and cached `tokens`: (pool, events)."""
    pool = BlockPool(num_blocks, enable_caching=True)
    pool.events = KVEventLog(BS, "CPU")
    kv = KVCacheManager(pool, BS)
    req = Request("r", tokens, SamplingParams(max_tokens=1))
    assert kv.allocate_slots(req, len(tokens), 0, []) is not None
    req.num_computed_tokens = len(tokens)
    kv.cache_blocks(req, len(tokens))
    return pool, pool.events.take()


@pytest.mark.parametrize("length", [1, 4, 5, 13, 17])
def test_prompt_keys_are_the_keys_the_engine_pool_caches(length):
    rng = random.Random(length)
    tokens = [rng.randrange(1000) for _ in range(length)]
    pool, _ = cache_prompt(tokens)
    # The pool caches every full block; the router counts only those a later request could be
    # served (never the last token), i.e. all of them when the prompt ends one past a block.
    servable = (length - 1) // BS
    keys = prompt_block_hashes(tokens, BS)
    assert len(keys) == servable
    assert set(keys) <= pool.cached_block_hashes()
    assert set(prompt_block_hashes(tokens + [7], BS)) == pool.cached_block_hashes()


def stored(tokens: list[int]) -> list:
    """The events a replica's pool sends after computing `tokens`."""
    return cache_prompt(tokens)[1]


PROMPT = list(range(100, 113))           # 3 full blocks of 4 servable, + 1 token
OTHER = list(range(500, 513))


def kv_router(**kw) -> KVAwareRouter:
    router = KVAwareRouter(BS, **kw)
    router.set_replicas(["a", "b", "c"])
    return router


def test_kv_aware_sends_a_prompt_to_the_replica_holding_its_longest_prefix():
    router = kv_router()
    router.apply_events("a", stored(PROMPT[:5]))         # 1 block of the prompt
    router.apply_events("b", stored(PROMPT))             # all 3
    router.apply_events("c", stored(OTHER))
    d = router.choose(PROMPT)
    assert (d.replica_id, d.matched_blocks, d.reason) == ("b", 3, "prefix")
    # A different continuation of the first block: a holds that block, b too; b is tied on
    # blocks, so the lower load decides.
    router.started("b")
    d = router.choose(PROMPT[:4] + [9, 9, 9, 9, 9])
    assert (d.replica_id, d.matched_blocks) == ("a", 1)
    # Nobody holds it: least loaded (a and c idle, b has one in flight): the first of them.
    d = router.choose([1, 2, 3, 4, 5, 6])
    assert (d.replica_id, d.matched_blocks, d.reason) == ("a", 0, "least-loaded")


def test_a_held_block_after_a_miss_is_no_prefix():
    router = kv_router()
    router.apply_events("b", stored(PROMPT))
    router.apply_events("b", [BlockRemoved([prompt_block_hashes(PROMPT, BS)[0]], "CPU")])
    d = router.choose(PROMPT)
    assert d.matched_blocks == 0 and d.reason == "least-loaded"


def test_an_overloaded_holder_is_passed_over_within_the_bound_only():
    router = kv_router(imbalance_threshold=2)
    router.apply_events("b", stored(PROMPT))
    for _ in range(2):
        router.started("b")
    assert router.choose(PROMPT).replica_id == "b"       # 2 above the floor: within the bound
    router.started("b")
    d = router.choose(PROMPT)                            # 3 above: the least loaded instead
    assert (d.replica_id, d.reason) == ("a", "overloaded-holder")
    router.finished("b")
    assert router.choose(PROMPT).replica_id == "b"
    # Reported queue counts as load too, and a nearly full pool disqualifies.
    router.report_load("b", num_waiting=5, num_running=1, kv_usage=0.2)
    assert router.choose(PROMPT).replica_id == "a"
    router.report_load("b", num_waiting=0, num_running=0, kv_usage=0.97)
    assert router.choose(PROMPT).reason == "overloaded-holder"


def test_removed_blocks_cleared_pools_and_dead_replicas_are_forgotten():
    router = kv_router()
    router.apply_events("b", stored(PROMPT))
    keys = prompt_block_hashes(PROMPT, BS)
    router.apply_events("b", [BlockRemoved(keys[2:], "CPU")])
    assert router.choose(PROMPT).matched_blocks == 2
    router.apply_events("b", [AllBlocksCleared()])
    assert router.choose(PROMPT).reason == "least-loaded"
    router.apply_events("c", stored(PROMPT))
    router.remove_replica("c")                            # died
    assert all(router.choose(PROMPT).replica_id != "c" for _ in range(5))
    router.apply_events("c", stored(PROMPT))              # a late batch from the dead one: ignored
    router.add_replica("c")                               # restarted by Ray: an empty pool
    assert router.choose(PROMPT).matched_blocks == 0
    router.set_replicas(["a"])
    assert set(router.replicas) == {"a"}


def test_the_vllm_wire_format_drives_the_same_decisions():
    """Batches as a ZMQ subscriber decodes them (engine/kv_events.py's vLLM-format messages)."""
    from pagedserve.engine.kv_events import KVEventBatch, to_wire

    wire = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=to_wire(stored(PROMPT))))
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(wire)
    router = kv_router()
    router.apply_events("c", batch.events)
    d = router.choose(PROMPT)
    assert (d.replica_id, d.matched_blocks) == ("c", 3)


def test_round_robin_and_power_of_two():
    rr = RoundRobinRouter(BS)
    rr.set_replicas(["x", "y", "z"])
    assert [rr.choose(PROMPT).replica_id for _ in range(6)] == ["x", "y", "z", "x", "y", "z"]
    p2 = PowerOfTwoRouter(BS, seed=3)
    p2.set_replicas(["x", "y"])
    for _ in range(3):
        p2.started("x")
    assert {p2.choose(PROMPT).replica_id for _ in range(20)} == {"y"}   # two of two: always the lighter
    p3 = PowerOfTwoRouter(BS, seed=3)
    p3.set_replicas(["x", "y", "z"])
    for _ in range(5):
        p3.started("z")
    picks = Counter(p3.choose(PROMPT).replica_id for _ in range(300))
    # z only wins a draw of z against nobody: never; x and y share the rest.
    assert picks["z"] == 0 and picks["x"] > 50 and picks["y"] > 50
    again = PowerOfTwoRouter(BS, seed=3)
    again.set_replicas(["x", "y", "z"])
    for _ in range(5):
        again.started("z")
    assert Counter(again.choose(PROMPT).replica_id for _ in range(300)) == picks   # seeded: reproducible


def test_make_router_names_and_no_replicas():
    assert make_router("kv-aware", BS, imbalance_threshold=1).imbalance_threshold == 1
    with pytest.raises(ValueError, match="router"):
        make_router("random", BS)
    with pytest.raises(RuntimeError, match="no live replica"):
        make_router("round-robin", BS).choose(PROMPT)


def test_serve_replica_flags_and_the_documented_serve_run_config():
    import argparse
    import pathlib

    import yaml

    from pagedserve.config import EngineConfig
    from pagedserve.server.cli import register, server_settings

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    settings = server_settings(parser.parse_args(["serve", "--replicas", "2", "--router", "round-robin"]))
    assert (settings["replicas"], settings["router"]) == (2, "round-robin")
    assert server_settings(parser.parse_args(["serve"]))["replicas"] is None
    with pytest.raises(ValueError, match="replicas"):
        server_settings(parser.parse_args(["serve", "--replicas", "0"]))
    config = yaml.safe_load((pathlib.Path(__file__).parents[1] / "deploy" / "serve-replicas.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "pagedserve.fleet.serve:app_builder"
    fleet_keys = {"replicas", "router", "cpus_per_replica", "advertise_host", "metric_names"}
    assert set(app["args"]) - fleet_keys <= set(EngineConfig.knob_names())
    assert app["args"]["router"] in ("round-robin", "power-of-two", "kv-aware")


def test_autoscale_builds_a_deployment_carrying_ray_serves_autoscaling_config():
    """`serve --autoscale 1:4` (and `serve run ... autoscale=1:4`): the engine deployment carries Ray
    Serve's autoscaling_config (target ongoing requests = max_num_seqs unless given); a bad spec is
    refused by name before anything starts. Nothing runs: the application is only built."""
    import argparse

    pytest.importorskip("ray.serve")
    from pagedserve.config import EngineConfig
    from pagedserve.fleet.cli import wants_replicas
    from pagedserve.fleet.serve import app_builder, build_fleet
    from pagedserve.server.cli import register, server_settings

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--autoscale", "1:4"])
    assert server_settings(args)["autoscale"] == "1:4" and wants_replicas(args)

    def engine_deployment(app):
        (engine_app,) = [a for a in app._bound_deployment.init_args if hasattr(a, "_bound_deployment")]
        return engine_app._bound_deployment

    config = EngineConfig(model="m", max_num_seqs=6)
    dep = engine_deployment(build_fleet(config, None, "round-robin", autoscale="1:4"))
    auto = dep._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.initial_replicas) == (1, 4, 1)
    assert auto.target_ongoing_requests == 6
    auto = engine_deployment(build_fleet(config, 2, "kv-aware", autoscale="1:3:2.5"))._deployment_config \
        .autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.initial_replicas, auto.target_ongoing_requests) == (1, 3, 2, 2.5)
    fixed = engine_deployment(build_fleet(config, 2, "kv-aware"))._deployment_config
    assert fixed.autoscaling_config is None and fixed.num_replicas == 2
    auto = engine_deployment(app_builder({"model": "m", "autoscale": "2:5"}))._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas) == (2, 5)
    for bad in ("4", "3:1", "0:2", "1:x", "1:2:0"):
        with pytest.raises(ValueError, match="autoscale"):
            build_fleet(config, None, "round-robin", autoscale=bad)
    with pytest.raises(ValueError, match="replicas"):
        build_fleet(config, 5, "round-robin", autoscale="1:4")


def test_a_replica_reserves_every_rank_and_a_dp_replica_is_refused(capsys):
    """A -tp/-pp replica's ranks are its own processes: Ray reserves each rank's CPUs (GPUs on
    CUDA) for the one replica, and the ranks' torch threads are that share, not the actor's
    whole OMP_NUM_THREADS. A -dp replica (several cores behind one KV-event endpoint) is refused
    by name before Ray starts, as is the ray executor inside a replica. Nothing runs."""
    pytest.importorskip("ray.serve")
    from pagedserve.cli import main
    from pagedserve.config import EngineConfig
    from pagedserve.fleet.serve import build_fleet, rank_threads

    def actor_options(app):
        (engine_app,) = [a for a in app._bound_deployment.init_args if hasattr(a, "_bound_deployment")]
        return engine_app._bound_deployment.ray_actor_options

    assert actor_options(build_fleet(EngineConfig(model="m"), 2, "round-robin"))["num_cpus"] == 1
    tp2 = actor_options(build_fleet(EngineConfig(model="m", tensor_parallel_size=2), 2, "kv-aware",
                                    cpus_per_replica=1.5))
    assert tp2["num_cpus"] == 3 and not tp2.get("num_gpus")
    pp2 = actor_options(build_fleet(EngineConfig(model="m", pipeline_parallel_size=2), 1, "kv-aware"))
    assert pp2["num_cpus"] == 2
    gpu = actor_options(build_fleet(EngineConfig(model="m", tensor_parallel_size=2, device="cuda"), 1, "kv-aware"))
    assert (gpu["num_cpus"], gpu["num_gpus"]) == (1, 2)
    # Ray gave the tp=2 actor OMP_NUM_THREADS=2: each rank takes 1; an operator's 1 stays 1; tp=1 untouched.
    assert [rank_threads(2, 1.0, "2"), rank_threads(2, 1.0, "1"), rank_threads(2, 4.0, None),
            rank_threads(1, 1.0, "2")] == ["1", "1", "4", None]
    with pytest.raises(ValueError, match="data_parallel_size: a replica is one engine core"):
        build_fleet(EngineConfig(model="m", data_parallel_size=2), 2, "kv-aware")
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        build_fleet(EngineConfig(model="m", tensor_parallel_size=2, distributed_executor_backend="ray"), 1,
                    "kv-aware")
    with pytest.raises(ValueError, match="cpus_per_replica"):
        build_fleet(EngineConfig(model="m"), 1, "kv-aware", cpus_per_replica=0)
    # The command line: refused with one line, before Ray (or any model load) starts.
    assert main(["serve", "--model", "m", "--replicas", "2", "-dp", "2"]) == 2
    err = capsys.readouterr().err
    assert "data_parallel_size: a replica is one engine core" in err and "--replicas N x 2" in err
