"""The executor an EngineConfig asks for (config.distributed_executor_backend):

    uni   the ModelRunner in the engine-core process (tensor_parallel_size 1)
    mp    one worker process per rank (worker/multiproc_executor.py)
    ray   one Ray actor per rank, in a placement group (worker/ray_executor.py; optional extra)
"""
from __future__ import annotations

from pagedserve.config import EngineConfig, resolve_kv_cache_dtype
from pagedserve.core.executor import Executor
from pagedserve.model.config import ModelConfig


def make_executor(config: EngineConfig, model_config: ModelConfig, dtype: str,
                  eos_token_ids: frozenset[int], grammar_compiler=None) -> Executor:
    backend = config.distributed_executor_backend
    if backend == "mp":
        from pagedserve.worker.multiproc_executor import MultiprocExecutor
        return MultiprocExecutor(config, dtype, eos_token_ids)
    if backend == "ray":
        from pagedserve.worker.ray_executor import RayExecutor
        return RayExecutor(config, dtype, eos_token_ids)
    from pagedserve.worker.model_runner import ModelRunner
    shard = None
    dp_experts = config.data_parallel_size > 1 and config.enable_expert_parallel and model_config.moe is not None
    if dp_experts:  # DP attention + EP: this core's model meets the other cores' in their MoE layers
        from pagedserve.model.config import TPShard
        from pagedserve.worker.dp_lockstep import init_dp_group

        shard = TPShard.of(model_config, 1, 0, True, config.data_parallel_size, config.data_parallel_rank)
        init_dp_group(config)
    runner = ModelRunner(model_config, dtype, config.device, config.block_size, eos_token_ids, config.seed,
                         grammar_compiler=grammar_compiler, shard=shard,
                         kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype, dtype))
    if dp_experts:
        from pagedserve.worker.dp_lockstep import DPLockstep
        runner.dp_lockstep = DPLockstep(runner)
    return runner
