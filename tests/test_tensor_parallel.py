"""Tensor parallelism (tp=2, gloo on CPU): greedy output equals HF transformers token for token
with chunked prefill, prefix caching and forced preemption (swap, then recompute), on a GQA
Llama (KV heads split) and a Qwen2 with qkv bias and one KV head (replicated on both ranks);
each rank's KV pool is exactly the bytes `pagedserve plan` gives; bad tp values are refused.

A tp=2 engine costs two process starts, so each model gets one, shared by the module.
Sums across ranks may flip a greedy pick where HF's top two logits are within ~1e-5: a
mismatch is accepted only where the test shows HF's top-2 gap at the first divergent
position is below TIE_GAP; everywhere else the tokens must be identical.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

from checkpoints import hf_greedy, make_checkpoint
from pagedserve import LLM, SamplingParams
from pagedserve.config import PreemptionMode

TIE_GAP = 1e-4
NUM_PROMPTS = 22
BLOCK_SIZE = 16
# Per-rank KV budget: small enough that 22 prompts of up to 400 tokens preempt often.
KV_BYTES = 170_000
ENGINE_ARGS = dict(tensor_parallel_size=2, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64,
                   block_size=BLOCK_SIZE, kv_cache_memory=KV_BYTES, preemption_mode="swap",
                   enable_prefix_caching=True)


def make_workload(seed: int = 1):
    rng = random.Random(seed)
    lengths = [1, 2, 16, 17, 399, 400] + [rng.randint(1, 400) for _ in range(NUM_PROMPTS - 6)]
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in lengths]
    shared = [rng.randrange(2, 384) for _ in range(48)]  # prefix-cache hits across requests
    for i in range(6, NUM_PROMPTS, 4):
        prompts[i] = (shared + prompts[i])[:400]
    max_tokens = [rng.randint(1, 24) for _ in lengths]
    return prompts, max_tokens


def top2_gap(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_greedy_parity(path, prompts, got, want) -> int:
    """Identical tokens, except where HF itself has a near-tie at the first divergence.
    Returns how many sequences diverged (at a tie)."""
    import transformers

    model = None
    ties = 0
    for i, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        assert len(g) == len(w), f"prompt {i}: {len(g)} tokens, HF made {len(w)}"
        pos = next(j for j in range(len(w)) if g[j] != w[j])
        if model is None:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        gap = top2_gap(model, prompts[i] + w[:pos])
        assert gap < TIE_GAP, (f"prompt {i} (len {len(prompts[i])}): token {pos} is {g[pos]}, HF says {w[pos]} "
                               f"with a top-2 logit gap of {gap:.2e} (not a tie)")
        ties += 1
    return ties


class TPCase:
    def __init__(self, path, llm, prompts, max_tokens, ref) -> None:
        self.path, self.llm, self.prompts, self.max_tokens, self.ref = path, llm, prompts, max_tokens, ref

    def generate(self) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in self.max_tokens]
        outs = self.llm.generate(self.prompts, params, use_tqdm=False)
        pool = self.llm.engine.block_pool
        assert pool.num_free_blocks == pool.num_blocks  # every block came back
        return [o.outputs[0].token_ids for o in outs]


def _case(tmp_path_factory, arch: str, **shape) -> TPCase:
    path = make_checkpoint(tmp_path_factory.mktemp(f"tp-{arch}"), arch, **shape)
    prompts, max_tokens = make_workload()
    ref = hf_greedy(path, prompts, max_tokens)
    return TPCase(path, LLM(str(path), **ENGINE_ARGS), prompts, max_tokens, ref)


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory):
    case = _case(tmp_path_factory, "llama", heads=4, kv_heads=2)  # GQA: one KV head per rank
    yield case
    case.llm.shutdown()


@pytest.fixture(scope="module")
def qwen2_tp2(tmp_path_factory):
    case = _case(tmp_path_factory, "qwen2", heads=4, kv_heads=1)  # qkv bias; its one KV head on both ranks
    yield case
    case.llm.shutdown()


def _force(case: TPCase, mode: PreemptionMode) -> dict:
    """Run the workload with every preemption in `mode`; returns this run's counters."""
    sched = case.llm.engine.scheduler
    sched.config.preemption_mode = mode
    before = dict(sched.total_preemptions_by_mode), sched.total_partial_prefills, sched.kv.prefix_hits
    got = case.generate()
    ties = assert_greedy_parity(case.path, case.prompts, got, case.ref)
    return {"preempted": sched.total_preemptions_by_mode[mode.value] - before[0][mode.value],
            "other_mode": sum(sched.total_preemptions_by_mode.values()) - sum(before[0].values())
            - (sched.total_preemptions_by_mode[mode.value] - before[0][mode.value]),
            "partial_prefills": sched.total_partial_prefills - before[1],
            "prefix_hits": sched.kv.prefix_hits - before[2], "ties": ties}


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_llama_gqa_tp2_matches_hf(llama_tp2, mode):
    run = _force(llama_tp2, mode)
    assert run["preempted"] > 0 and run["other_mode"] == 0, run
    assert run["partial_prefills"] > 0 and run["prefix_hits"] > 0, run


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_qwen2_replicated_kv_tp2_matches_hf(qwen2_tp2, mode):
    run = _force(qwen2_tp2, mode)
    assert run["preempted"] > 0 and run["other_mode"] == 0, run
    assert run["partial_prefills"] > 0, run


def _plan(path, tp: int):
    from pagedserve.plan.budget import PlanRequest, compute_plan
    from pagedserve.plan.gpus import custom_gpu
    from pagedserve.plan.models import load_model

    return compute_plan(PlanRequest(model=load_model(str(path)), device=custom_gpu(0, name="CPU"), device_kind="cpu",
                                    kv_cache_memory=KV_BYTES, tensor_parallel_size=tp, block_size=BLOCK_SIZE,
                                    max_model_len=512))


@pytest.mark.parametrize("which", ["llama_tp2", "qwen2_tp2"])
def test_each_rank_allocates_the_pool_plan_prints(which, request):
    case = request.getfixturevalue(which)
    plan = _plan(case.path, 2)
    engine = case.llm.engine
    assert engine.pool_sizing.num_blocks == plan.pool.num_blocks
    assert engine.pool_sizing.bytes_per_token == plan.kv_bytes_per_token
    # the tensors each rank really allocated, and its weights as loaded (before GEMM packing)
    assert engine.executor.rank_kv_bytes == [plan.pool.num_bytes] * 2
    (stage,) = plan.stages
    assert engine.executor._call("weight_bytes") == [stage.weight_bytes] * 2


def test_llama_tp2_halves_kv_per_token_qwen2_replicates():
    """The per-rank bytes above are not trivially equal: Llama's two KV heads split (half the
    bytes per token of tp=1), Qwen2's one head does not (the same bytes, on both ranks)."""
    from pagedserve.plan.kv_budget import ModelShape, kv_bytes_per_token

    llama = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16)
    qwen = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=1, head_dim=16)
    assert kv_bytes_per_token(llama, 4, 2) * 2 == kv_bytes_per_token(llama, 4, 1)
    assert kv_bytes_per_token(qwen, 4, 2) == kv_bytes_per_token(qwen, 4, 1)


def test_replicated_kv_heads_warn_like_plan(tmp_path, caplog):
    """tp > KV heads: the engine logs the very warning `plan` prints (checked without
    starting ranks: the pool sizing runs before any executor call that needs them)."""
    from pagedserve.config import EngineConfig, ResolvedConfig
    from pagedserve.engine.llm_engine import build_engine_core
    from pagedserve.model.config import read_model_config

    path = make_checkpoint(tmp_path / "mqa", "qwen2", heads=4, kv_heads=1)
    config = EngineConfig(model=str(path), tensor_parallel_size=2, kv_cache_memory=KV_BYTES, max_model_len=512,
                          preemption_mode="recompute")
    settings = ResolvedConfig(config.resolved_copy(1024), read_model_config(path), "float32", "float32", frozenset())

    class NoModel:  # the pool is sized before any rank is asked anything
        def initialize_cache(self, num_blocks: int, num_host_blocks: int) -> None:
            pass

        def shutdown(self) -> None:
            pass

    with caplog.at_level(logging.WARNING, logger="pagedserve.engine"):
        build_engine_core(settings, executor=NoModel())
    warning = next(w for w in _plan(path, 2).warnings if "replicated" in w)
    assert warning in caplog.text


def test_tp_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size") as e:
        LLM(str(tiny_llama), tensor_parallel_size=3, num_kv_blocks=64, max_model_len=256)
    assert "3 does not divide the model's 4 attention heads" in str(e.value)


@pytest.mark.parametrize("heads, kv_heads, inter, tp, needle", [
    (12, 3, 96, 2, "2 neither divides the model's 3 KV heads"),
    (8, 2, 100, 8, "8 does not divide the model's intermediate_size 100"),
    (8, 2, 96, 4, None),   # 2 KV heads over 4 ranks: each replicated twice, allowed
])
def test_tp_shape_checks_name_the_numbers(heads, kv_heads, inter, tp, needle):
    from pagedserve.model.config import check_tensor_parallel

    if needle is None:
        check_tensor_parallel(heads, kv_heads, inter, tp)
        return
    with pytest.raises(ValueError, match="tensor_parallel_size") as e:
        check_tensor_parallel(heads, kv_heads, inter, tp)
    assert needle in str(e.value)


def test_uni_backend_with_tp_is_refused():
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_ray_backend_tp2_matches_hf(llama_tp2):
    """The same ranks as Ray actors on a local Ray instance (loopback), same answers."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        prompts, max_tokens = llama_tp2.prompts[:6], llama_tp2.max_tokens[:6]
        with LLM(str(llama_tp2.path), **{**ENGINE_ARGS, "distributed_executor_backend": "ray"}) as llm:
            assert len(llm.engine.executor.actors) == 2
            outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                          for n in max_tokens], use_tqdm=False)
        assert_greedy_parity(llama_tp2.path, prompts, [o.outputs[0].token_ids for o in outs], llama_tp2.ref[:6])
    finally:
        ray.shutdown()


def test_tp_flag_means_the_same_in_serve_plan_and_simulate_and_their_pools_agree(llama_tp2):
    """-tp parses to one tensor_parallel_size in serve, simulate and plan; the simulator's
    per-rank pool, plan's and the running tp=2 engine's are the same blocks."""
    from pagedserve.cli import build_parser
    from pagedserve.config import EngineConfig
    from pagedserve.engine_args import engine_config_from_args
    from pagedserve.plan.budget import compute_plan
    from pagedserve.plan.cli import build_request
    from pagedserve.sim.cost_model import CostParams
    from pagedserve.sim.simulator import build_deployment

    path = str(llama_tp2.path)
    parser = build_parser()
    serve = engine_config_from_args(parser.parse_args(["serve", "--model", path, "-tp", "2"]))
    sim = engine_config_from_args(parser.parse_args(["simulate", "--model", path, "--device", "cpu",
                                                     "--tensor-parallel-size", "2"]))
    plan_args = parser.parse_args(["plan", "--model", path, "--device", "cpu", "-tp", "2", "--kv-cache-memory",
                                   str(KV_BYTES), "--max-model-len", "512"])
    assert serve.tensor_parallel_size == sim.tensor_parallel_size == plan_args.tensor_parallel_size == 2
    plan = compute_plan(build_request(plan_args))
    dep = build_deployment(EngineConfig(model=path, tensor_parallel_size=2, kv_cache_memory=KV_BYTES,
                                        max_model_len=512, block_size=BLOCK_SIZE), path,
                           cost_params=CostParams(peak_flops=1e12, mem_bandwidth=1e11))
    assert dep.tp == 2
    assert dep.num_blocks == plan.pool.num_blocks == llama_tp2.llm.engine.pool_sizing.num_blocks
    assert dep.bytes_per_block == plan.pool.bytes_per_block == llama_tp2.llm.engine.pool_sizing.bytes_per_block


SCRIPT_BODY = """from pagedserve import LLM, SamplingParams
llm = LLM({path!r}, tensor_parallel_size=2, num_kv_blocks=64, max_model_len=256)
out = llm.generate([{prompt!r}], SamplingParams(max_tokens={n}, temperature=0.0, ignore_eos=True), use_tqdm=False)
print("TOKENS", list(out[0].outputs[0].token_ids))
llm.shutdown()
"""


def _run_script(tmp_path, name: str, source: str):
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pagedserve

    script = tmp_path / name
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(Path(pagedserve.__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    return script, subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                                  cwd=str(tmp_path), timeout=600)


def test_tp_script_without_main_guard_stops_with_one_line_naming_the_fix(tiny_llama, tmp_path):
    """Ranks start with spawn, which imports the script again in each rank: a script whose
    LLM(...) sits at module level (no `if __name__ == "__main__":`) stops with one line that
    names the guard, not with multiprocessing's bootstrap traceback from every rank and a
    bare "rank 0 died: exit code 1"; the same script with the guard gives HF's tokens."""
    import textwrap

    prompt, n = [5, 6, 7, 8, 9], 6
    body = SCRIPT_BODY.format(path=str(tiny_llama), prompt=prompt, n=n)
    script, bare = _run_script(tmp_path, "unguarded.py", body)
    assert bare.returncode != 0, bare.stdout + bare.stderr
    assert "TOKENS" not in bare.stdout
    last = bare.stderr.strip().splitlines()[-1]
    assert last == ("pagedserve.worker.multiproc_executor.UnguardedMainError: tensor_parallel_size=2 starts its "
                    f"ranks with multiprocessing 'spawn', which imports {script} again in each rank, and that "
                    "import builds the engine again: put the code that builds LLM(...) under "
                    "`if __name__ == \"__main__\":`"), bare.stderr
    for noise in ("bootstrapping phase", "multiprocessing/spawn.py", "died"):
        assert noise not in bare.stderr, bare.stderr

    # The fix the line names works, and the ranks give HF's tokens.
    guarded = "if __name__ == \"__main__\":\n" + textwrap.indent(body, "    ")
    _, fixed = _run_script(tmp_path, "guarded.py", guarded)
    assert fixed.returncode == 0, fixed.stderr
    got = next(line for line in fixed.stdout.splitlines() if line.startswith("TOKENS"))
    assert got == f"TOKENS {hf_greedy(tiny_llama, [prompt], [n])[0]}"
