"""`pagedserve plan` and the simulator size the KV pool the way the engine really allocates it.

The reference is the engine's own pool after start-up: its block count and the bytes of the
KV tensor it allocated (dtype included), for fp32, bf16 and fp16, and for dtype=auto on a
bf16 checkpoint (which computes in fp32 on CPU). The numbers are also worked out by hand.
"""
from __future__ import annotations

import json

import pytest

from checkpoints import make_checkpoint
from pagedserve.cli import main
from pagedserve.config import EngineConfig
from pagedserve.sim.cost_model import CostParams
from pagedserve.sim.simulator import build_deployment

BUDGET = 3_000_000  # bytes: not a multiple of any block size, so the floor is tested too
# 2 layers x (K, V) x 2 KV heads x head_dim 16 = 128 values per token
VALUES_PER_TOKEN = 2 * 2 * 2 * 16
ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    import torch
    return make_checkpoint(tmp_path_factory.mktemp("bf16"), "llama", dtype=torch.bfloat16)


def real_pool(model_dir, dtype: str) -> tuple[int, int, str]:
    """(blocks, bytes of the allocated KV tensor, its dtype) of a started engine.
    (The one place that knows where the engine keeps its pool and KV tensor.)"""
    from pagedserve.engine import Engine

    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, kv_cache_memory=BUDGET,
                                 preemption_mode="recompute"))
    kv = engine.executor.kv_cache
    return engine.block_pool.num_blocks, kv.numel() * kv.element_size(), str(kv.dtype).removeprefix("torch.")


def planned_pool(model_dir, dtype: str, capsys) -> dict:
    argv = ["plan", "--model", str(model_dir), "--device", "cpu", "--kv-cache-memory", str(BUDGET), "--json"]
    if dtype != "auto":
        argv += ["--dtype", dtype]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["kv"]


def simulated_pool(model_dir, dtype: str):
    cost = CostParams(peak_flops=1e12, mem_bandwidth=1e11, gemm_mfu=0.1, gemm_mbu=0.1, attn_mfu=0.1, attn_mbu=0.1)
    return build_deployment(EngineConfig(dtype=dtype, kv_cache_memory=BUDGET), str(model_dir), cost_params=cost)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_plan_and_simulator_size_the_engines_real_pool(tiny_llama, dtype, capsys):
    blocks, tensor_bytes, tensor_dtype = real_pool(tiny_llama, dtype)
    per_block = 16 * VALUES_PER_TOKEN * ITEM_BYTES[dtype]
    assert tensor_dtype == dtype
    assert blocks == BUDGET // per_block and tensor_bytes == blocks * per_block <= BUDGET  # 366 or 732 by hand
    plan = planned_pool(tiny_llama, dtype, capsys)
    assert (plan["num_blocks"], plan["bytes_per_block"]) == (blocks, per_block)
    assert plan["num_blocks"] * plan["bytes_per_block"] == tensor_bytes
    sim = simulated_pool(tiny_llama, dtype)
    assert (sim.num_blocks, sim.bytes_per_block) == (blocks, per_block)


def test_plan_and_simulator_follow_the_engines_auto_dtype_on_cpu(bf16_checkpoint, capsys):
    blocks, tensor_bytes, tensor_dtype = real_pool(bf16_checkpoint, "auto")
    assert tensor_dtype == "float32"  # CPU computes half-precision checkpoints in fp32
    assert simulated_pool(bf16_checkpoint, "auto").num_blocks == blocks
    plan = planned_pool(bf16_checkpoint, "auto", capsys)
    # (bytes alone cannot tell: 732 bf16 blocks fill the budget as 366 fp32 blocks do)
    assert (plan["num_blocks"], plan["num_blocks"] * plan["bytes_per_block"]) == (blocks, tensor_bytes)
