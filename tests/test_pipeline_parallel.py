"""Pipeline parallelism (pp=2, two gloo ranks on CPU): greedy output equals HF transformers
token for token under chunked prefill, prefix caching and forced preemption (swap, then
recompute) on a dense Llama, a tied-embedding Qwen2, Mixtral, Qwen2-MoE and DeepSeek-V3
(MLA); each stage's weights and KV pool are exactly the bytes `pagedserve plan
--pipeline-parallel-size 2` gives per stage; the split is vLLM's; a layout the model cannot
fill is refused before any process starts; a stage that dies fails its requests.

The engines run with micro-batches of at least 8 tokens (PAGEDSERVE_PP_MICRO_BATCH_TOKENS; the
default 256 would never cut these small steps), so steps are cut into two micro-batches that
follow each other through the stages, and steps too small to cut run whole: both paths are
checked against HF.

Every checkpoint has 3 decoder layers, so the split is uneven (vLLM gives the remainder to
the stage before the last: layers 0-1 and 2) and the two stages' pools differ. Stages only
move activations (no sums across ranks change), so no near-tie allowance: every token must
be HF's.
"""
from __future__ import annotations

import multiprocessing

import pytest

from checkpoints import HFGreedyReference, config_from_flags, greedy_outputs, make_checkpoint, parity_workload
from pagedserve import LLM
from pagedserve.config import PreemptionMode

NUM_LAYERS = 3
NUM_PROMPTS = 10
BLOCK_SIZE = 16
# 16 blocks of 16 = 256 tokens for 10 prompts of up to 150 tokens: the pool runs dry;
# a 32-token budget chunks every longer prompt.
ENGINE_ARGS = dict(pipeline_parallel_size=2, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
                   block_size=BLOCK_SIZE, num_kv_blocks=16, swap_space="16MiB", enable_prefix_caching=True,
                   preemption_mode="swap")
MODELS = {"llama": dict(), "qwen2": dict(kv_heads=1), "mixtral": dict(), "qwen2_moe": dict(), "deepseek_v3": dict()}


class PPCase:
    def __init__(self, arch: str, path, llm: LLM) -> None:
        self.arch, self.path, self.llm = arch, path, llm
        self.prompts, self.max_tokens = parity_workload(NUM_PROMPTS)
        self.ref = HFGreedyReference(path)

    def run(self, mode: PreemptionMode) -> dict:
        self.llm.engine.executor.reset_stats()
        sched = self.llm.engine.scheduler
        sched.config.preemption_mode = mode
        before = (sched.total_preemptions, sched.total_partial_prefills, sched.kv.prefix_hits,
                  sched.total_blocks_swapped["in"], sched.total_recomputed_tokens)
        self.ref.assert_greedy(self.prompts, greedy_outputs(self.llm, self.prompts, self.max_tokens), self.max_tokens,
                               f"{self.arch} {mode.value}: ")
        after = (sched.total_preemptions, sched.total_partial_prefills, sched.kv.prefix_hits,
                 sched.total_blocks_swapped["in"], sched.total_recomputed_tokens)
        run = dict(zip(["preempted", "partial_prefills", "prefix_hits", "swapped_in", "recomputed"],
                       (a - b for a, b in zip(after, before))))
        stats = self.llm.engine.executor.worker_stats()
        run["micro_batches"] = stats[0]["pp_micro_batches"]
        run["steps"] = stats[0]["num_steps"]
        return run


@pytest.fixture(scope="module", params=list(MODELS))
def pp_case(request, tmp_path_factory):
    arch = request.param
    path = make_checkpoint(tmp_path_factory.mktemp(f"pp-{arch}"), arch, layers=NUM_LAYERS, **MODELS[arch])
    with pytest.MonkeyPatch.context() as m:
        m.setenv("PAGEDSERVE_PP_MICRO_BATCH_TOKENS", "8")  # the ranks read it when they start
        llm = LLM(str(path), **ENGINE_ARGS)
    yield PPCase(arch, path, llm)
    llm.shutdown()


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_pp2_matches_hf_under_chunking_prefix_caching_and_preemption(pp_case, mode):
    run = pp_case.run(mode)
    assert run["preempted"] > 0 and run["partial_prefills"] > 0 and run["prefix_hits"] > 0, run
    # some steps were cut in two (two micro-batches each), others ran whole
    assert 0 < run["micro_batches"] < 2 * run["steps"], run
    if mode is PreemptionMode.SWAP:
        assert run["swapped_in"] > 0, run
    else:
        assert run["recomputed"] > 0, run


def _plan(path, pp: int):
    from pagedserve.plan.budget import PlanRequest, compute_plan
    from pagedserve.plan.gpus import custom_gpu
    from pagedserve.plan.models import load_model

    # kv_cache_memory: the bytes of 16 blocks of the largest stage, so plan sizes the engine's 16
    stage_bytes = compute_plan(PlanRequest(model=load_model(str(path)), device=custom_gpu(0, name="CPU"),
                                           device_kind="cpu", kv_cache_memory=1 << 30, block_size=BLOCK_SIZE,
                                           pipeline_parallel_size=pp, max_model_len=256)).pool.bytes_per_block
    return compute_plan(PlanRequest(model=load_model(str(path)), device=custom_gpu(0, name="CPU"), device_kind="cpu",
                                    kv_cache_memory=16 * stage_bytes, pipeline_parallel_size=pp,
                                    block_size=BLOCK_SIZE, max_model_len=256))


def test_each_stage_holds_the_weights_and_pool_plan_prints(pp_case):
    plan = _plan(pp_case.path, 2)
    engine = pp_case.llm.engine
    assert [(s.first_layer, s.num_layers) for s in plan.stages] == [(0, 2), (2, 1)]
    assert engine.pool_sizing.num_blocks == plan.pool.num_blocks == 16
    assert engine.pool_sizing.bytes_per_token == plan.pool.bytes_per_token == plan.stages[0].kv_bytes_per_token
    # what each rank really allocated: its stage's layers only, the same blocks on both
    want_kv = [plan.pool.num_blocks * BLOCK_SIZE * s.kv_bytes_per_token for s in plan.stages]
    assert engine.executor.rank_kv_bytes == want_kv
    assert want_kv[0] == 2 * want_kv[1]  # 2 layers and 1 layer: not trivially equal
    assert engine.executor._call("weight_bytes") == [s.weight_bytes for s in plan.stages]


@pytest.mark.parametrize("num_layers, pp, want", [
    # vLLM's get_pp_indices (tests/distributed/test_pipeline_partition.py): an even split, the
    # remainder added to the stages just before the last one
    (5, 2, [(0, 3), (3, 5)]),
    (5, 3, [(0, 2), (2, 4), (4, 5)]),
    (20, 4, [(0, 5), (5, 10), (10, 15), (15, 20)]),
    (7, 4, [(0, 2), (2, 4), (4, 6), (6, 7)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
])
def test_stage_split_is_vllms(num_layers, pp, want):
    from pagedserve.model.pipeline import PipelineStage

    stages = [PipelineStage.of(num_layers, pp, r) for r in range(pp)]
    assert [(s.first_layer, s.end_layer) for s in stages] == want
    assert [s.is_first for s in stages] == [True] + [False] * (pp - 1)
    assert [s.is_last for s in stages] == [False] * (pp - 1) + [True]


@pytest.mark.parametrize("tokens, pp, min_tokens, want", [
    ([1] * 8, 2, 4, [(0, 4), (4, 8)]),              # 8 decodes: two runs of 4
    ([1] * 8, 2, 8, [(0, 8)]),                      # two runs would hold fewer than 8 tokens each
    ([1] * 8, 2, 256, [(0, 8)]),                    # under the threshold: one batch
    ([1, 1, 30], 2, 8, [(0, 2), (2, 3)]),           # cut where the tokens balance best
    ([40], 2, 8, [(0, 1)]),                         # one request cannot be split
    ([5, 5, 5, 5, 5, 5], 3, 8, [(0, 2), (2, 4), (4, 6)]),
    ([30, 1, 1, 1], 2, 8, [(0, 1), (1, 4)]),
    ([10, 10], 2, 0, [(0, 2)]),                     # 0: off
])
def test_micro_batch_bounds(tokens, pp, min_tokens, want):
    from pagedserve.model.pipeline import micro_batch_bounds

    got = micro_batch_bounds(tokens, pp, min_tokens)
    assert got == want
    assert got[0][0] == 0 and got[-1][1] == len(tokens) and all(a < b for a, b in got)
    assert all(got[i][1] == got[i + 1][0] for i in range(len(got) - 1))


def test_more_stages_than_layers_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    import pagedserve.worker.multiproc_executor as mp_executor

    path = make_checkpoint(tmp_path / "llama", "llama", layers=NUM_LAYERS)

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started for a layout that cannot run")

    monkeypatch.setattr(mp_executor.MultiprocExecutor, "__init__", no_ranks)
    before = set(multiprocessing.active_children())  # other tests' engines may still be up
    with pytest.raises(ValueError, match="pipeline_parallel_size") as e:
        LLM(str(path), pipeline_parallel_size=4, num_kv_blocks=64, max_model_len=256)
    assert "4 stages, but the model has 3 decoder layers" in str(e.value)
    assert set(multiprocessing.active_children()) <= before


@pytest.mark.parametrize("kwargs, needle", [
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size: must be an integer >= 1, got 0"),
    (dict(pipeline_parallel_size=1.5), "pipeline_parallel_size: must be an integer >= 1, got 1.5"),
    (dict(pipeline_parallel_size=2, distributed_executor_backend="uni"), "pipeline_parallel_size=2 needs mp or ray"),
    (dict(pipeline_parallel_size=2, tensor_parallel_size=2), "pipeline_parallel_size: 2 with tensor_parallel_size=2 "
                                                             "is not implemented"),
])
def test_bad_pipeline_parallel_size_is_refused_by_name(kwargs, needle):
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError) as e:
        EngineConfig(**kwargs)
    assert needle in str(e.value)


def test_pp_defaults_to_the_mp_executor_and_is_a_serve_flag():
    from pagedserve.config import EngineConfig
    assert EngineConfig(pipeline_parallel_size=2).distributed_executor_backend == "mp"
    for flag in ("-pp", "--pipeline-parallel-size"):
        assert config_from_flags([flag, "2"]).pipeline_parallel_size == 2


def test_sigkill_a_stage_fails_requests_turns_health_503_and_exits_naming_it(tmp_path):
    """Rank 0 (stage 0) never replies to the engine: the last stage's rank does, and it is
    blocked in its receive from the dead stage. The death is still seen at once (its process
    sentinel), as for a tensor-parallel rank."""
    from test_scaleout_faults import Served, kill_a_rank_under_load

    model = make_checkpoint(tmp_path / "llama", "llama", layers=NUM_LAYERS)
    server = Served(tmp_path, model, "--pipeline-parallel-size", "2", "--engine-core-mode", "process")
    rank_pids = kill_a_rank_under_load(server, 0, num_ranks=2)
    log = server.log()
    assert f"rank 0 (pid {rank_pids[0]}) died: killed by SIGKILL" in log, log[-3000:]


def test_ray_backend_pp2_matches_hf(tmp_path):
    """The same two stages as Ray actors on a local Ray instance (loopback): the driver is the
    last stage's actor, and the answers are HF's."""
    import ray

    path = make_checkpoint(tmp_path / "llama", "llama", layers=NUM_LAYERS)
    prompts, max_tokens = (part[:6] for part in parity_workload(NUM_PROMPTS))
    ref = HFGreedyReference(path)
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        with LLM(str(path), **{**ENGINE_ARGS, "distributed_executor_backend": "ray"}) as llm:
            assert len(llm.engine.executor.actors) == 2 and llm.engine.executor.driver == 1
            got = greedy_outputs(llm, prompts, max_tokens)
    finally:
        ray.shutdown()
    ref.assert_greedy(prompts, got, max_tokens)


def test_cuda_profile_gives_the_blocks_the_tightest_stage_holds():
    """Stages measure different budgets (stage 0 holds the embedding, the last the head) and
    hold different layers per block: the engine sizes the pool by the largest stage's bytes
    per token, so the budget it gets must be the one that gives the fewest blocks of all."""
    from pagedserve.worker.worker import RankCalls

    class TwoStages(RankCalls):
        def __init__(self, budgets, layers):
            self.answers = {"profile_kv_budget": budgets, "num_stage_layers": layers}

        def _call(self, method, *args):
            return self.answers[method]

    per_layer_block = 1000  # bytes of one block of one layer
    # stage 0: 2 layers, 10_000 bytes -> 5 blocks; stage 1: 1 layer, 4_000 bytes -> 4 blocks
    budget = TwoStages([10_000, 4_000], [2, 1]).profile_kv_budget(0.9, 256, 8)
    assert budget // (2 * per_layer_block) == 4  # sized by stage 0's bytes per block: stage 1's 4 blocks
    # the plain minimum of the budgets (4_000) would give 2 blocks of stage 0's size
    assert TwoStages([4_000, 10_000], [1, 2]).profile_kv_budget(0.9, 256, 8) // (2 * per_layer_block) == 4
