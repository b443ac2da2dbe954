"""Tensor and expert parallelism for MoE and MLA models (tp=2, gloo on CPU): greedy output
equals HF transformers token for token on tiny Mixtral, Qwen2-MoE and DeepSeek-V3 (MLA)
checkpoints, with the experts split by their intermediate dimension (vLLM's default) and
with --enable-expert-parallel (whole experts per rank), under chunked prefill, prefix
caching and forced preemption (swap, then recompute); each rank's weight and KV-pool bytes
are the ones `pagedserve plan` prints for the same flags; layouts the model cannot be
divided by are refused, with the numbers, before any rank starts.

Each (model, layout) engine costs two process starts, so each is built once per module and
runs the workload once per preemption mode.
"""
from __future__ import annotations

import pytest

from checkpoints import HFGreedyReference, greedy_outputs, make_checkpoint, parity_workload
from pagedserve import LLM
from pagedserve.config import PreemptionMode

ARCHS = ("mixtral", "qwen2_moe", "deepseek_v3")
LAYOUTS = {"tp2": False, "tp2-ep": True}   # name -> enable_expert_parallel
NUM_PROMPTS = 8
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
# Per-rank pool: 17 blocks (MLA, 320 B/token) to 21 (one KV head per rank, 256 B/token),
# for 8 prompts of up to 150 + 24 tokens: it runs dry and preempts.
KV_BYTES = 90_000
ENGINE_ARGS = dict(tensor_parallel_size=2, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32,
                   block_size=BLOCK_SIZE, kv_cache_memory=KV_BYTES, enable_prefix_caching=True,
                   swap_space="16MiB", preemption_mode="swap")


def workload():
    return parity_workload(NUM_PROMPTS, fixed_lengths=(1, 17, 150), seed=3)


_CHECKPOINTS: dict = {}


def _checkpoint(arch, tmp_path_factory):
    if arch not in _CHECKPOINTS:
        path = make_checkpoint(tmp_path_factory.mktemp(arch), arch)
        _CHECKPOINTS[arch] = (path, HFGreedyReference(path))
    return _CHECKPOINTS[arch]


class Case:
    def __init__(self, arch: str, layout: str, path, ref: HFGreedyReference) -> None:
        self.arch, self.layout, self.path, self.ref = arch, layout, path, ref
        self.expert_parallel = LAYOUTS[layout]
        self.prompts, self.max_tokens = workload()
        self.llm = LLM(str(path), enable_expert_parallel=self.expert_parallel, **ENGINE_ARGS)


@pytest.fixture(scope="module", params=[(a, layout) for a in ARCHS for layout in LAYOUTS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, tmp_path_factory):
    arch, layout = request.param
    path, ref = _checkpoint(arch, tmp_path_factory)
    c = Case(arch, layout, path, ref)
    yield c
    c.llm.shutdown()


def _run(case: Case, mode: PreemptionMode) -> dict:
    sched = case.llm.engine.scheduler
    sched.config.preemption_mode = mode
    before = (dict(sched.total_preemptions_by_mode), sched.total_partial_prefills, sched.kv.prefix_hits)
    case.ref.assert_greedy(case.prompts, greedy_outputs(case.llm, case.prompts, case.max_tokens), case.max_tokens,
                           f"{case.arch} {case.layout} {mode.value}: ")
    by_mode = sched.total_preemptions_by_mode
    return {"preempted": by_mode[mode.value] - before[0][mode.value],
            "other_mode": sum(by_mode.values()) - sum(before[0].values()) - (by_mode[mode.value] - before[0][mode.value]),
            "partial_prefills": sched.total_partial_prefills - before[1],
            "prefix_hits": sched.kv.prefix_hits - before[2]}


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_tp2_and_tp2_ep_match_hf_under_chunking_and_preemption(case, mode):
    run = _run(case, mode)
    assert run["preempted"] > 0 and run["other_mode"] == 0, run
    assert run["partial_prefills"] > 0 and run["prefix_hits"] > 0, run


def _plan(case: Case):
    from pagedserve.plan.budget import PlanRequest, compute_plan
    from pagedserve.plan.gpus import custom_gpu
    from pagedserve.plan.models import load_model

    return compute_plan(PlanRequest(model=load_model(str(case.path)), device=custom_gpu(0, name="CPU"),
                                    device_kind="cpu", kv_cache_memory=KV_BYTES, tensor_parallel_size=2,
                                    enable_expert_parallel=case.expert_parallel, block_size=BLOCK_SIZE,
                                    max_model_len=MAX_MODEL_LEN))


def test_each_rank_holds_the_weights_and_pool_plan_prints(case):
    """What the ranks really allocated (weights as loaded, before GEMM packing; the KV pool
    tensors) equals plan's per-GPU numbers for the same flags, and the experts are laid out
    as the flag says: whole experts, disjoint across ranks, under EP; a half of every
    expert's intermediate dimension without it."""
    plan = _plan(case)
    engine = case.llm.engine
    executor = engine.executor
    (stage,) = plan.stages
    assert executor._call("weight_bytes") == [stage.weight_bytes] * 2
    assert engine.pool_sizing.num_blocks == plan.pool.num_blocks
    assert executor.rank_kv_bytes == [plan.pool.num_bytes] * 2
    moe = engine.model_config.moe
    layouts = executor._call("expert_layout")
    num_sparse = sum(moe.sparse_layers)
    if case.expert_parallel:
        half = moe.num_experts // 2
        assert layouts == [[[0, half, moe.intermediate_size]] * num_sparse,
                           [[half, half, moe.intermediate_size]] * num_sparse]
        assert stage.routed_experts_per_gpu == half
    else:
        assert layouts == [[[0, moe.num_experts, moe.intermediate_size // 2]] * num_sparse] * 2
    if engine.model_config.mla is not None:   # the latent is whole on every rank: tp does not shrink it
        assert engine.pool_sizing.bytes_per_token == engine.model_config.num_layers * (32 + 8) * 4


@pytest.mark.parametrize("arch, shape, engine_args, needle", [
    ("mixtral", dict(num_local_experts=3), dict(enable_expert_parallel=True),
     "enable_expert_parallel: the expert-parallel size 2 (= tensor_parallel_size) does not divide the model's 3 experts"),
    ("qwen2_moe", dict(moe_intermediate_size=33), dict(),
     "tensor_parallel_size: 2 does not divide the experts' intermediate size 33"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=49), dict(enable_expert_parallel=True),
     "tensor_parallel_size: 2 does not divide the shared experts' intermediate size 49"),
    ("deepseek_v3", dict(heads=6, kv_heads=6), dict(tensor_parallel_size=4),
     "tensor_parallel_size: 4 does not divide the model's 6 attention heads"),
    ("llama", dict(), dict(enable_expert_parallel=True),
     "enable_expert_parallel: LlamaForCausalLM has no experts to spread"),
])
def test_a_layout_the_model_cannot_divide_is_refused_before_any_rank_starts(tmp_path, monkeypatch, arch, shape,
                                                                             engine_args, needle):
    from pagedserve.worker import multiproc_executor

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(multiproc_executor.MultiprocExecutor, "__init__", no_ranks)
    path = make_checkpoint(tmp_path / arch, arch, **shape)
    with pytest.raises(ValueError) as e:
        LLM(str(path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=32, **{"tensor_parallel_size": 2, **engine_args})
    assert needle in str(e.value)


def test_expert_parallel_layout_that_divides_is_accepted_where_the_intermediate_split_is_not(tmp_path):
    """Whole experts need no split of their intermediate dimension: 33 does not halve, 8
    experts do (checked without starting ranks)."""
    from pagedserve.model.config import check_model_parallel, read_model_config

    cfg = read_model_config(make_checkpoint(tmp_path / "odd", "qwen2_moe", moe_intermediate_size=33))
    check_model_parallel(cfg, 2, expert_parallel=True)
    with pytest.raises(ValueError, match="intermediate size 33"):
        check_model_parallel(cfg, 2, expert_parallel=False)


def test_enable_expert_parallel_flag_means_the_same_in_serve_simulate_and_plan(tmp_path):
    """vLLM's flag: serve and generate take it into the engine config; simulate (which has
    the engine's flags) still reads it into its layout, and plan into its request."""
    from pagedserve.cli import build_parser
    from pagedserve.engine_args import engine_config_from_args
    from pagedserve.plan.cli import build_request
    from pagedserve.sim.cli import deployment_layout

    path = str(make_checkpoint(tmp_path / "mixtral", "mixtral"))
    parser = build_parser()
    serve = engine_config_from_args(parser.parse_args(["serve", "--model", path, "-tp", "2",
                                                       "--enable-expert-parallel"]))
    assert serve.enable_expert_parallel is True and serve.tensor_parallel_size == 2
    assert engine_config_from_args(parser.parse_args(["serve", "--model", path])).enable_expert_parallel is False
    sim_args = parser.parse_args(["simulate", "--model", path, "--device", "cpu", "-tp", "2",
                                  "--enable-expert-parallel"])
    assert engine_config_from_args(sim_args).enable_expert_parallel is True
    assert deployment_layout(sim_args, tp=2)["layout"].expert_parallel
    plan_args = parser.parse_args(["plan", "--model", path, "--device", "cpu", "-tp", "2", "--enable-expert-parallel",
                                   "--kv-cache-memory", str(KV_BYTES)])
    assert build_request(plan_args).enable_expert_parallel is True


def test_ray_backend_runs_mla_with_expert_parallel_like_hf(tmp_path_factory):
    """The same ranks as Ray actors (local Ray on loopback): DeepSeek-V3, tp=2 + EP."""
    import ray

    path, ref = _checkpoint("deepseek_v3", tmp_path_factory)
    prompts, max_tokens = workload()
    prompts, max_tokens = prompts[:4], max_tokens[:4]
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        with LLM(str(path), enable_expert_parallel=True, **{**ENGINE_ARGS, "distributed_executor_backend": "ray"}) as llm:
            assert len(llm.engine.executor.actors) == 2
            assert [layers[0][:2] for layers in llm.engine.executor._call("expert_layout")] == [[0, 4], [4, 4]]
            got = greedy_outputs(llm, prompts, max_tokens)
        ref.assert_greedy(prompts, got, max_tokens)
    finally:
        ray.shutdown()


def test_sigkill_an_expert_parallel_rank_fails_requests_turns_health_503_and_exits_naming_it(tmp_path_factory):
    """tp=2 + EP on DeepSeek-V3 (MLA, shared experts): rank 1 (experts 4-7) is killed under
    load while rank 0 waits in the MoE layer's all-reduce: every request in flight ends with
    an error, /health turns 503, the server exits non-zero naming the rank and leaves no
    process behind, as for a dense tensor-parallel rank (tests/test_scaleout_faults.py)."""
    from test_scaleout_faults import Served, kill_a_rank_under_load

    path, _ = _checkpoint("deepseek_v3", tmp_path_factory)
    tmp_path = tmp_path_factory.mktemp("ep-kill")
    server = Served(tmp_path, path, "--tensor-parallel-size", "2", "--enable-expert-parallel",
                    "--engine-core-mode", "process")
    rank_pids = kill_a_rank_under_load(server, 1, num_ranks=2)
    log = server.log()
    assert f"tensor-parallel rank 1 (pid {rank_pids[1]}) died: killed by SIGKILL" in log, log[-3000:]
