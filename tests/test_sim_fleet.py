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


def _lone_requests(model_dir, hop=None, serving=None, arrivals=(0.0,), output_len=4):
    from pagedserve.bench.workloads import WorkloadRequest

    dep = build_deployment(EngineConfig(**ENGINE), str(model_dir), cost_params=cpu_params())
    work = [WorkloadRequest([20 + i] * 40, None, 40, output_len, arrival_time=t) for i, t in enumerate(arrivals)]
    return simulate_fleet(dep, work, 2, "round-robin", hop=hop, serving=serving).records


def test_the_fleet_hop_adds_what_a_lone_request_crosses(tmp_path):
    """One request alone: its TTFT is the engine's plus the inbound hop, the admission, the
    delivery and one chunk's way back; each later token is a step plus the replica's end of the
    stream later (the replica's lock with its engine). It reaches its engine only after the hop:
    never scheduled before."""
    from pagedserve.sim.cost_model import ServingOverhead
    from pagedserve.sim.fleet import FleetHop

    model = write_config(tmp_path / "m")
    (bare,) = _lone_requests(model)
    hop = FleetHop(request_s=0.5, per_prompt_token_s=0.001, chunk_s=0.03, replica_cpu_per_chunk_s=0.002)
    serving = ServingOverhead(admit_s=0.004, deliver_s=0.006, serial=True)
    (rec,) = _lone_requests(model, hop, serving)
    ttft = lambda r: r.first_token_time - r.arrival   # noqa: E731
    assert ttft(rec) == pytest.approx(ttft(bare) + 0.5 + 0.04 + 0.004 + 0.006 + 0.03)
    gaps = lambda r: [b - a for a, b in zip(r.token_times, r.token_times[1:])]   # noqa: E731
    assert gaps(rec) == pytest.approx([g + 0.002 for g in gaps(bare)])


def test_the_proxy_and_the_ingress_queue_a_burst(tmp_path):
    """Two requests at once, one per replica (round-robin). Alone, each takes request_s (0.07 s:
    the proxy's 0.02 s of CPU, then the ingress's 0.05 s) to reach its replica; together, the
    second waits out the first's turn at the ingress (0.05 s), and the first's token, back
    through the ingress, waits for the ingress to finish the second's request work."""
    from pagedserve.sim.fleet import FleetHop, _Stages

    model = write_config(tmp_path / "m")
    (bare,) = _lone_requests(model)
    engine_ttft = bare.first_token_time - bare.arrival
    hop = FleetHop(request_s=0.07, proxy_cpu_per_request_s=0.02, ingress_cpu_per_request_s=0.05)
    (alone,) = _lone_requests(model, hop)
    assert alone.first_token_time == pytest.approx(0.07 + engine_ttft)
    first, second = _lone_requests(model, hop, arrivals=(0.0, 0.0))
    assert second.first_token_time == pytest.approx(0.07 + 0.05 + engine_ttft)
    assert first.first_token_time == pytest.approx(0.07 + 0.05)   # the ingress busy with the second until then
    stages = _Stages()   # a cheap proxy then a dear ingress: only the ingress queues
    path = (("proxy", 0.01), ("ingress", 0.05))
    assert [stages.wait(0.0, path) for _ in range(3)] == pytest.approx([0.0, 0.05, 0.10])


def test_a_replica_steps_slower_by_its_share_of_a_core(tmp_path):
    """step_scale: each step of a replica takes that many times the cost model's (its TTFT and its
    gaps, for one request alone); contention_scale is the fleet probe's step wall / CPU over the
    calibration trace's (here 3 against a trace whose steps took twice their CPU time)."""
    import json

    from pagedserve.sim.fleet import FleetHop, contention_scale

    model = write_config(tmp_path / "m")
    (bare,) = _lone_requests(model)
    (slow,) = _lone_requests(model, FleetHop(step_scale=2.0))
    assert slow.first_token_time == pytest.approx(2 * bare.first_token_time)
    assert slow.token_times == pytest.approx([2 * t for t in bare.token_times])
    trace = tmp_path / "steps.jsonl"
    trace.write_text("\n".join(json.dumps({"new_tokens": [1], "context_lens": [9 + k], "step_time": 0.004 + k * 1e-3,
                                           "duration": 0.004, "cpu_time": 0.002 + k * 5e-4}) for k in range(3)))
    assert contention_scale({"replica_step_stretch": 3.0}, trace) == pytest.approx(1.5)


def test_cli_simulate_replicas_with_the_fleet_path(tmp_path, capsys):
    """`simulate --replicas 2 --fleet-overhead shipped`: the probe's hop is printed and charged
    (every TTFT at least its inbound hop and one chunk's way back later than without); a
    missing FILE is refused by name."""
    import json

    from pagedserve.cli import main
    from pagedserve.sim.fleet import default_fleet_hop

    run = ["simulate", "--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--max-num-seqs", "16", "--workload", "random",
           "--random-input-len", "200", "--random-output-len", "8", "--num-prompts", "20", "--request-rate", "10",
           "--replicas", "2", "--router", "round-robin"]
    ttft = {}
    for overhead in ("none", "shipped"):
        out = tmp_path / f"{overhead}.json"
        assert main([*run, "--fleet-overhead", overhead, "--result-json", str(out)]) == 0
        ttft[overhead] = json.loads(out.read_text())["p50_ttft_ms"]
    assert "fleet hop:" in capsys.readouterr().out
    hop = default_fleet_hop(engine_thread=False)
    assert hop.request_s > 0 and hop.replica_cpu_per_chunk_s == 0
    assert ttft["shipped"] >= ttft["none"] + (hop.request_s + hop.chunk_s) * 1e3 - 1e-6
    assert main([*run, "--fleet-overhead", str(tmp_path / "missing.json")]) == 2
    assert "fleet_overhead: no file" in capsys.readouterr().err


def test_one_replica_without_a_hop_is_the_single_engine_request_for_request():
    """The fleet's replicas admit and deliver through the simulator's own serving loop
    (sim/serving_loop.py): one replica and no hop gives simulate()'s times exactly, with the GPU
    preset's serving terms (one event loop, the admission split at its tokenizer await), in a
    burst and with arrivals landing mid-step."""
    from pagedserve.bench.workloads import WorkloadRequest, arrival_times
    from pagedserve.sim.cost_model import ServingOverhead
    from pagedserve.sim.simulator import simulate

    dep = build_deployment(EngineConfig(max_num_seqs=16), "llama-3.1-8b", gpu="H100-SXM")
    serving = ServingOverhead.from_dict(dep.cost_model.params.serving)
    assert serving.serial and serving.tokenize_off_loop and serving.admit_s > 0
    for times in ([0.0] * 12, arrival_times(24, 40.0, seed=3)):
        work = [WorkloadRequest(None, None, 100 + 37 * (i % 7), 6 + i % 5, arrival_time=t) for i, t in enumerate(times)]
        single = {r.request_id: r for r in simulate(dep, work, seed=0).records}
        fleet = simulate_fleet(dep, work, 1, "round-robin", seed=0).records
        assert len(fleet) == len(single)
        for r in fleet:
            assert r.token_times == pytest.approx(single[r.request_id].token_times, abs=1e-9), r.request_id
