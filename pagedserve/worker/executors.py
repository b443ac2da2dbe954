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
    return ModelRunner(model_config, dtype, config.device, config.block_size, eos_token_ids, config.seed,
                       grammar_compiler=grammar_compiler,
                       kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype, dtype))
