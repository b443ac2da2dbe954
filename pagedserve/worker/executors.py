"""The executor a resolved config asks for (config.distributed_executor_backend):

    uni   the ModelRunner in the engine-core process (tensor_parallel_size 1)
    mp    one worker process per rank (worker/multiproc_executor.py)
    ray   one Ray actor per rank, in a placement group (worker/ray_executor.py; optional extra)
"""
from __future__ import annotations

from pagedserve.config import ResolvedConfig
from pagedserve.core.executor import Executor


def make_executor(settings: ResolvedConfig, grammar_compiler=None, load_grammar_compiler: bool = False) -> Executor:
    """`grammar_compiler`: the in-process front-end's, for a uni runner (ranks and a runner
    in the engine-core process, `load_grammar_compiler`, build their own)."""
    backend = settings.config.distributed_executor_backend
    if backend == "mp":
        from pagedserve.worker.multiproc_executor import MultiprocExecutor
        return MultiprocExecutor(settings)
    if backend == "ray":
        from pagedserve.worker.ray_executor import RayExecutor
        return RayExecutor(settings)
    from pagedserve.worker.model_runner import LOAD_GRAMMAR_COMPILER, ModelRunner
    config = settings.config
    dp_experts = config.data_parallel_size > 1 and config.enable_expert_parallel and settings.model_config.moe is not None
    if dp_experts:  # DP attention + EP: this core's model meets the other cores' in their MoE layers
        from pagedserve.worker.dp_lockstep import init_dp_group
        init_dp_group(config)
    runner = ModelRunner.for_rank(settings, config.device,
                                  grammar_compiler=LOAD_GRAMMAR_COMPILER if load_grammar_compiler else grammar_compiler)
    if dp_experts:
        from pagedserve.worker.dp_lockstep import DPLockstep
        runner.dp_lockstep = DPLockstep(runner)
    return runner
