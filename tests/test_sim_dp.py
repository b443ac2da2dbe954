"""`simulate -dp N` (sim/data_parallel.py): N copies of the engine core behind the DP client's
own placement rule (core/dp_balance.py, which engine/dp_client.py calls), and DP attention + EP
in lockstep: each turn lasts the slowest core plus the MoE exchange, an idle core runs a dummy
pass. What is still not simulated (-dp with -tp or -pp, as the engine refuses it) is refused
with the numbers."""
from __future__ import annotations

import json

import pytest

from checkpoints import make_checkpoint
from pagedserve.bench.workloads import WorkloadRequest
from pagedserve.cli import main
from pagedserve.config import EngineConfig
from pagedserve.plan.parallel import ParallelLayout
from pagedserve.sim.cost_model import CostParams
from pagedserve.sim.data_parallel import IDLE_TICK_S, simulate_dp
from pagedserve.sim.parallel_cost import DPExpertParallelCost
from pagedserve.sim.simulator import build_deployment

BLOCK = 16


def cpu_params() -> CostParams:
    return CostParams(peak_flops=1e12, mem_bandwidth=1e11, gemm_mfu=0.05, gemm_mbu=0.2, attn_mfu=0.02,
                      attn_mbu=0.1, step_overhead_s=1e-3, per_request_overhead_s=1e-4,
                      link_bandwidth=2e9, allreduce_latency_s=5e-5)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("sim-dp-llama"), "llama")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("sim-dp-mixtral"), "mixtral", layers=2)


def deployment(path, dp: int = 2, ep: bool = False, **config):
    cfg = dict(model=str(path), max_model_len=256, num_kv_blocks=64, block_size=BLOCK, max_num_batched_tokens=256,
               enable_prefix_caching=True) | config
    return build_deployment(EngineConfig(**cfg), str(path), cost_params=cpu_params(),
                            layout=ParallelLayout(1, 1, dp, enable_expert_parallel=ep))


def request(ids, output_len, at) -> WorkloadRequest:
    return WorkloadRequest(list(ids), None, len(ids), output_len, arrival_time=at)


def test_dp2_places_a_scripted_sequence_where_the_balancer_rule_says(llama):
    a, b, c = ([10 + k] * 32 for k in range(3))          # 2 full blocks each, distinct
    workload = [
        request(a, 4, 0.0), request(b, 4, 0.0), request(c, 4, 0.0),  # a burst: 0; 1 (core 0 has 1 pending);
        #                                                              then 4 = 4: tie, no prefix, same usage -> 0
        request(a + [6] * 8, 4, 100.0),    # idle, equal load: a's two blocks were placed on core 0 -> 0
        request(b + [7] * 8, 4, 150.0),    # idle, equal load: b's are on core 1 -> 1 (not the lower rank)
        request(a + [8] * 8, 50, 200.0),   # a's blocks are on core 0 -> 0
        request(a + [9] * 8, 4, 200.001),  # a's blocks again, but core 0 has a request: the load wins -> 1
    ]
    placed = []
    result = simulate_dp(deployment(llama), workload, on_place=lambda i, rank: placed.append((i, rank)))
    assert placed == [(0, 0), (1, 1), (2, 0), (3, 0), (4, 1), (5, 0), (6, 1)]
    assert [core["requests"] for core in result.per_core] == [4, 3]
    assert result.metrics["completed"] == 7 and not result.data_parallel["lockstep"]
    assert result.per_core[1]["prefix_cache_hits"] >= 2 * BLOCK   # request 4 reused b's blocks on core 1


def test_lockstep_turn_is_the_slowest_core_plus_the_exchange_and_an_idle_core_runs_a_dummy_pass(moe):
    dep = deployment(moe, ep=True)
    cost = dep.lockstep_cost
    assert isinstance(cost, DPExpertParallelCost)
    both = cost.turn([([40], [40], 0, 1), ([20], [20], 0, 1)])
    alone = [cost.core_step([40], [40], 0, 1, 60), cost.core_step([20], [20], 0, 1, 60)]
    assert both.cores == alone and both.dummy == [False, False]
    assert both.exchange > 0 and both.total == max(alone) + both.exchange
    assert all(both.total > t for t in alone)
    one = cost.turn([([1], [41], 0, 1), None])
    assert one.dummy == [False, True] and one.cores[1] == cost.dummy_pass(1) > 0
    assert one.total == max(one.cores) + one.exchange
    # a core's experts work for every core's tokens: more tokens elsewhere, a longer step and dummy pass
    assert cost.core_step([20], [20], 0, 1, 60) > cost.core_step([20], [20], 0, 1, 20)
    assert cost.dummy_pass(60) > cost.dummy_pass(1)
    # and it holds (reads) only its half of the experts: a decode costs less than the whole model's
    whole = deployment(moe).cost_model
    assert cost.core_step([1], [41], 0, 1, 1) < whole.predict([1], [41])
    assert cost.exchange([40, 20]) > cost.exchange([1, 0]) > cost.exchange([0, 0]) > 0   # bytes, then the agreement


def test_simulate_dp2_ep_stamps_both_cores_at_each_turn_end_and_counts_dummy_passes(moe):
    """Two requests at t=0, one per core: every turn ends for both at once, its length the
    hand-priced turn; after the short one finishes, its core runs a dummy pass each turn."""
    dep = deployment(moe, ep=True)
    cost = dep.lockstep_cost
    workload = [request([20 + i for i in range(40)], 6, 0.0), request([90 + i for i in range(20)], 2, 0.0)]
    result = simulate_dp(dep, workload)
    a, b = result.records
    turns = [cost.turn([([40], [40], 0, 1), ([20], [20], 0, 1)]).total,
             cost.turn([([1], [41], 0, 1), ([1], [21], 0, 1)]).total]
    turns += [cost.turn([([1], [42 + k], 0, 1), None]).total for k in range(4)]
    assert a.first_token_time == b.first_token_time == pytest.approx(turns[0], rel=1e-12)
    assert b.finish == pytest.approx(sum(turns[:2]), rel=1e-12)
    assert a.finish == pytest.approx(sum(turns), rel=1e-12)
    assert [c["num_dummy_passes"] for c in result.per_core] == [0, 4]
    assert result.data_parallel["turns"] == 6


def test_lockstep_waits_for_the_idle_tick_after_an_idle_spell(moe):
    from pagedserve.engine.core_loop import IDLE_WAIT

    assert IDLE_TICK_S == IDLE_WAIT
    dep = deployment(moe, ep=True)
    (rec,) = simulate_dp(dep, [request(list(range(20, 40)), 1, 0.1)]).records
    assert rec.first_token_time == pytest.approx(IDLE_TICK_S + dep.lockstep_cost.turn([([20], [20], 0, 1), None]).total)


def test_cli_simulates_dp2_and_dp2_ep_with_per_core_lines(moe, tmp_path, capsys):
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps(cpu_params().to_dict()))
    common = ["simulate", "--device", "cpu", "--model", str(moe), "--cost-model", str(cost), "--num-kv-blocks", "64",
              "--max-model-len", "256", "--num-prompts", "6", "--random-input-len", "40", "--random-output-len", "4"]
    for flags, lockstep in ((["-dp", "2"], False), (["-dp", "2", "--enable-expert-parallel"], True)):
        out_json = tmp_path / f"{lockstep}.json"
        assert main(common + flags + ["--result-json", str(out_json)]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "data-parallel engine 0:" in out and "data-parallel engine 1:" in out
        assert ("lockstep:" in out) == lockstep
        saved = json.loads(out_json.read_text())
        assert saved["completed"] == 6 and sum(c["requests"] for c in saved["per_core"]) == 6


@pytest.mark.parametrize("flags, words", [
    (["-dp", "2", "-tp", "2"], "data_parallel_size: 2 with tensor_parallel_size=2 and pipeline_parallel_size=1"),
    (["-dp", "2", "-pp", "2"], "data_parallel_size: 2 with tensor_parallel_size=1 and pipeline_parallel_size=2"),
    (["-dp", "3", "--enable-expert-parallel"], "enable_expert_parallel: 4 routed experts do not divide over "
                                               "data_parallel_size=3"),
], ids=["tp", "pp", "experts"])
def test_dp_refusals_that_remain_name_the_numbers(moe, tmp_path, flags, words, capsys):
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps(cpu_params().to_dict()))
    rc = main(["simulate", "--device", "cpu", "--model", str(moe), "--cost-model", str(cost), "--num-kv-blocks", "64",
               "--max-model-len", "256", "--num-prompts", "2", *flags])
    err = capsys.readouterr().err
    assert rc != 0 and words in err, (rc, err)


def test_dp_ep_on_a_dense_model_is_refused(llama):
    with pytest.raises(ValueError, match="enable_expert_parallel: the model has no experts"):
        deployment(llama, ep=True)


def test_gpu_dp_ep_pool_is_plans_per_gpu_pool_and_the_exchange_is_all_to_all():
    """On a GPU preset each simulated core gets `plan -dp 8 --enable-expert-parallel`'s per-GPU
    pool (the experts spread over the 8 GPUs leave more room than -dp 8 alone)."""
    from pagedserve.plan.budget import PlanRequest, compute_plan
    from pagedserve.plan.gpus import get_gpu
    from pagedserve.plan.models import load_model

    def dep(ep):
        config = EngineConfig(model="mixtral-8x7b", max_model_len=4096, max_num_seqs=64)
        return build_deployment(config, "mixtral-8x7b", gpu="H200",
                                layout=ParallelLayout(1, 1, 8, enable_expert_parallel=ep))

    with_ep, without = dep(True), dep(False)
    plan = compute_plan(PlanRequest(model=load_model("mixtral-8x7b"), device=get_gpu("H200"),
                                    data_parallel_size=8, enable_expert_parallel=True, max_model_len=4096,
                                    max_num_seqs=64, max_num_batched_tokens=with_ep.config.max_num_batched_tokens))
    assert with_ep.num_blocks == plan.pool.num_blocks > without.num_blocks
    assert with_ep.lockstep_cost.exchange_kind == "all-to-all" and without.lockstep_cost is None
    result = simulate_dp(with_ep, [request(list(range(16, 16 + 64 + k)), 8, 0.01 * k) for k in range(16)])
    assert result.metrics["completed"] == 16 and sum(c["requests"] for c in result.per_core) == 16
    # vLLM's idle DP ranks are woken for a request, not polled: no idle tick on a GPU preset
    (rec,) = simulate_dp(with_ep, [request(list(range(16, 80)), 1, 0.1)]).records
    assert rec.first_token_time < 0.1 + IDLE_TICK_S / 2


def test_tune_over_dp_layouts_prints_the_dp_flag_in_its_command(capsys):
    rc = main(["tune", "--model", "mixtral-8x7b", "--gpu", "H200", "--layouts", "DP8+EP8", "--max-model-len", "4096",
               "--num-prompts", "20", "--random-input-len", "128", "--random-output-len", "8", "--request-rate", "10"])
    out = capsys.readouterr().out
    assert rc == 0 and "--data-parallel-size 8 --enable-expert-parallel" in out, out


def test_dp1_is_the_single_engine_request_for_request():
    """-dp's cores sit behind one API server, the simulator's own serving loop
    (sim/serving_loop.py): one core gives simulate()'s times exactly, with the GPU preset's split
    serving terms (one event loop, the admission split at its tokenizer await), in a burst, with
    arrivals landing mid-step, and in closed loop."""
    from pagedserve.bench.workloads import arrival_times
    from pagedserve.sim.cost_model import ServingOverhead
    from pagedserve.sim.simulator import simulate

    dep = build_deployment(EngineConfig(max_num_seqs=16), "llama-3.1-8b", gpu="H100-SXM")
    serving = ServingOverhead.from_dict(dep.cost_model.params.serving)
    assert serving.serial and serving.tokenize_off_loop and serving.admit_s > 0
    for times, conc in (([0.0] * 12, None), (arrival_times(24, 40.0, seed=3), None), ([0.0] * 12, 4)):
        work = [WorkloadRequest(None, None, 100 + 37 * (i % 7), 6 + i % 5, arrival_time=t) for i, t in enumerate(times)]
        single = {r.request_id: r for r in simulate(dep, work, seed=0, max_concurrency=conc).records}
        dp = simulate_dp(dep, work, seed=0, max_concurrency=conc).records
        assert len(dp) == len(single)
        for r in dp:
            assert r.token_times == pytest.approx(single[r.request_id].token_times, abs=1e-9), r.request_id
