"""`simulate --device cpu` prices the layouts the engine runs on CPU ranks (gloo): TP with
--enable-expert-parallel and -pp, with a calibrated cost model, as it prices them on a
GPU (sim/parallel_cost.py); the pool is the one engine.size_pool gives the engine for the
same flags. A dense model with EP and DP combined with TP are still refused, by name (-dp
itself: tests/test_sim_dp.py)."""
from __future__ import annotations

import json

import pytest

from checkpoints import make_checkpoint
from pagedserve.cli import main
from pagedserve.config import EngineConfig
from pagedserve.core.engine_core import size_pool
from pagedserve.plan.models import load_model
from pagedserve.plan.parallel import ParallelLayout
from pagedserve.sim.cost_model import CostParams
from pagedserve.sim.parallel_cost import ParallelCostModel
from pagedserve.sim.simulator import build_deployment


def cpu_params() -> CostParams:
    return CostParams(peak_flops=1e12, mem_bandwidth=1e11, gemm_mfu=0.05, gemm_mbu=0.2, attn_mfu=0.02,
                      attn_mbu=0.1, step_overhead_s=1e-3, per_request_overhead_s=1e-4,
                      link_bandwidth=2e9, allreduce_latency_s=5e-5)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("sim-cpu-mixtral"), "mixtral", layers=4)


def test_cli_simulates_cpu_expert_parallel(moe, tmp_path, capsys):
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps(cpu_params().to_dict()))
    rc = main(["simulate", "--device", "cpu", "--model", str(moe), "--cost-model", str(cost),
               "--tensor-parallel-size", "2", "--enable-expert-parallel", "--num-kv-blocks", "64",
               "--max-model-len", "256", "--num-prompts", "6", "--random-input-len", "40",
               "--random-output-len", "4"])
    assert rc == 0, capsys.readouterr().err
    assert "Simulated Serving Result" in capsys.readouterr().out


@pytest.mark.parametrize("layout", [ParallelLayout(2, enable_expert_parallel=True), ParallelLayout(1, 2)],
                         ids=["tp2-ep", "pp2"])
def test_cpu_layouts_are_priced_by_the_parallel_model_on_the_engines_pool(moe, layout):
    config = EngineConfig(model=str(moe), max_model_len=256, kv_cache_memory="1MiB")
    dep = build_deployment(config, str(moe), cost_params=cpu_params(), layout=layout)
    assert isinstance(dep.cost_model, ParallelCostModel)
    t = dep.cost_model.breakdown([32, 1, 1], [32, 40, 50])
    if layout.expert_parallel:
        assert t.all_to_all > 0 and t.allreduce > 0
    else:
        assert t.pipeline > 0 and t.allreduce == 0
    engine = EngineConfig(model=str(moe), max_model_len=256, kv_cache_memory="1MiB", tensor_parallel_size=layout.tp,
                          pipeline_parallel_size=layout.pp, enable_expert_parallel=layout.expert_parallel)
    engine.resolve(1024)
    assert dep.num_blocks == size_pool(engine, load_model(str(moe)).shape, "float32").num_blocks


def test_cpu_refusals_that_remain_name_the_field(moe, tmp_path):
    dense = make_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        build_deployment(EngineConfig(model=str(dense), max_model_len=256, kv_cache_memory="1MiB"), str(dense),
                         cost_params=cpu_params(), layout=ParallelLayout(2, enable_expert_parallel=True))
    with pytest.raises(ValueError, match="data_parallel_size"):
        build_deployment(EngineConfig(model=str(moe), max_model_len=256, kv_cache_memory="1MiB"), str(moe),
                         cost_params=cpu_params(), layout=ParallelLayout(2, 1, 2))
