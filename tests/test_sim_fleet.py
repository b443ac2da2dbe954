"""The fleet simulator (sim/fleet.py): N real engine cores behind the real router code."""
from __future__ import annotations

import pytest

from pagedserve.config import EngineConfig
from pagedserve.sim.fleet import shared_prefix_workload, simulate_fleet
from pagedserve.sim.simulator import build_deployment
from test_sim import cpu_params, write_config

# A pool of 40 blocks of 16 (640 tokens) per replica; 6 tenants x 160-token prefixes = 60 blocks:
# more than one replica holds, less than two.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, num_kv_blocks=40, block_size=16,
              enable_prefix_caching=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = write_config(tmp_path_factory.mktemp("fleet") / "m")
    dep = build_deployment(EngineConfig(**ENGINE), str(model), cost_params=cpu_params())
    work = shared_prefix_workload(6, 160, 8, 4, 80, request_rate=20.0, vocab_size=512, seed=1)
    return {router: simulate_fleet(dep, work, 2, router, seed=0) for router in ("round-robin", "kv-aware")}


def test_every_request_finishes_and_the_router_saw_exactly_what_each_pool_holds(runs):
    for router, result in runs.items():
        assert all(r.completed and len(r.token_times) == 4 for r in result.records), router
        assert sum(result.requests_per_replica.values()) == 80
        for replica_id, core in result.cores.items():
            # The in-process KV events rebuilt each pool's cached keys exactly (the router's view).
            assert result.policy.replicas[replica_id].cached == core.cached_block_hashes(), (router, replica_id)
            assert result.policy.replicas[replica_id].in_flight == 0
            assert core.scheduler.kv.pool.num_free_blocks == ENGINE["num_kv_blocks"]  # every block came back


def test_kv_aware_keeps_tenants_on_replicas_and_hits_the_cache_more(runs):
    rr, kv = runs["round-robin"], runs["kv-aware"]
    assert kv.decisions.get("prefix", 0) > 40
    assert kv.prefix_hit_rate > rr.prefix_hit_rate + 0.1, (kv.prefix_hit_rate, rr.prefix_hit_rate)
    assert min(kv.requests_per_replica.values()) >= 16   # the imbalance bound keeps both replicas busy


def test_plan_prints_the_fleets_memory(capsys):
    import json

    from pagedserve.plan.cli import main

    assert main(["--model", "llama-3.1-8b", "--gpu", "H100-SXM", "-tp", "2", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(["--model", "llama-3.1-8b", "--gpu", "H100-SXM", "-tp", "2", "--replicas", "3", "--json"]) == 0
    fleet = json.loads(capsys.readouterr().out)["fleet"]
    assert fleet["gpus"] == 6 and fleet["gpus_per_replica"] == 2
    assert fleet["weight_bytes"] == 3 * one["model"]["weight_bytes_total"]
    assert fleet["kv_pool_tokens"] == 3 * one["kv"]["num_tokens"]
    assert main(["--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--replicas", "2"]) == 0
    assert "Fleet: 2 replicas, 2 GPUs (1 per replica)" in capsys.readouterr().out


def test_cli_simulate_replicas(tmp_path, capsys):
    """`simulate --replicas 2 --router kv-aware` on a GPU preset: the fleet report and its JSON."""
    import json

    from pagedserve.cli import main

    out = tmp_path / "fleet.json"
    assert main(["simulate", "--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--max-num-seqs", "16",
                 "--workload", "random", "--random-input-len", "200", "--random-output-len", "8",
                 "--num-prompts", "20", "--request-rate", "10", "--replicas", "2", "--router", "power-of-two",
                 "--result-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Simulated Fleet Result (2 x replica, router power-of-two)" in printed
    data = json.loads(out.read_text())
    assert data["replicas"] == 2 and sum(data["requests_per_replica"].values()) == 20 and data["completed"] == 20
    assert main(["simulate", "--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--num-prompts", "2",
                 "--replicas", "0"]) != 0
    assert "replicas: must be >= 1" in capsys.readouterr().err
