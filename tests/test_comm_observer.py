"""The communication hook benchmarks install (model/parallel.py's CommObserver, reached
through the executor's `set_comm_observer`): off by default, so a rank records nothing;
installed, each rank counts every collective of a tp=2 MoE run with the bytes the
Megatron layout moves: per forward of T tokens one all-reduce for the embedding and one
per attention block (T x hidden each), one MoE combine per layer (T x hidden), and a
logits gather; under pp=2 stage 0 sends and stage 1 receives one [2, T, hidden] payload per
step. Greedy output stays HF's with the observer on. No timing is asserted.
"""
from __future__ import annotations

import random

import pytest

from checkpoints import HFGreedyReference, make_checkpoint
from pagedserve import LLM, SamplingParams

HIDDEN, LAYERS = 64, 2


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("comm-mixtral"), "mixtral", hidden=HIDDEN, layers=LAYERS)
    llm = LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=True, max_model_len=256,
              max_num_batched_tokens=32, kv_cache_memory="4MiB", enable_prefix_caching=False)
    yield path, llm
    llm.shutdown()


def _workload(seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in (5, 40, 17)]
    return prompts, [4, 6, 3]


def _generate(llm, prompts, max_tokens):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    return llm.generate(prompts, params, use_tqdm=False)


def test_not_installed_records_nothing(tp2):
    from pagedserve.model.parallel import comm_observer

    _, llm = tp2
    ex = llm.engine.executor
    ex.set_comm_observer(False)
    ex.reset_stats()
    _generate(llm, *_workload(0))
    stats = ex.worker_stats()
    assert all(s["num_steps"] > 0 for s in stats)
    assert [s["comm"] for s in stats] == [None, None]
    assert comm_observer() is None  # nor in the engine's process


def test_installed_counts_each_collective_and_its_bytes(tp2):
    path, llm = tp2
    ex = llm.engine.executor
    ex.set_comm_observer(True)
    ex.reset_stats()
    prompts, max_tokens = _workload(1)
    outs = _generate(llm, prompts, max_tokens)
    stats = ex.worker_stats()
    ex.set_comm_observer(False)
    ref = HFGreedyReference(path)
    for o, prompt in zip(outs, prompts):
        assert ref.first_divergence(prompt, o.outputs[0].token_ids) is None
    # tokens the forward passes computed: every prompt once (no prefix cache, no preemption),
    # then each generated token but the last
    tokens = sum(len(p) for p in prompts) + sum(n - 1 for n in max_tokens)
    row = HIDDEN * 4  # fp32 activations
    for s in stats:
        comm, steps = s["comm"], s["num_steps"]
        assert comm["all_reduce"]["calls"] == steps * (1 + LAYERS), comm
        assert comm["all_reduce"]["bytes"] == tokens * row * (1 + LAYERS), comm
        assert comm["moe_combine"]["calls"] == steps * LAYERS, comm
        assert comm["moe_combine"]["bytes"] == tokens * row * LAYERS, comm
        assert comm["gather"]["calls"] > 0
        assert "pp_send" not in comm and "pp_recv" not in comm  # one stage: no sends
        assert s["calls"] == sum(comm[k]["calls"] for k in ("all_reduce", "moe_combine", "gather"))
        assert all(v["seconds"] >= 0 for v in comm.values())


def test_pp2_sends_and_receives_are_observed(tmp_path, monkeypatch):
    path = make_checkpoint(tmp_path / "pp-mixtral", "mixtral", hidden=HIDDEN, layers=LAYERS)
    monkeypatch.setenv("PAGEDSERVE_PP_MICRO_BATCH_TOKENS", "8")  # steps of >= 16 tokens are micro-batched
    llm = LLM(str(path), pipeline_parallel_size=2, max_model_len=256, max_num_batched_tokens=32,
              kv_cache_memory="4MiB", enable_prefix_caching=False)
    try:
        ex = llm.engine.executor
        ex.set_comm_observer(True)
        ex.reset_stats()
        prompts, max_tokens = _workload(2)
        _generate(llm, prompts, max_tokens)
        first, last = ex.worker_stats()
    finally:
        llm.shutdown()
    tokens = sum(len(p) for p in prompts) + sum(n - 1 for n in max_tokens)
    payload = tokens * 2 * HIDDEN * 4  # the layer output and the residual, fp32
    sends, recvs = first["comm"]["pp_send"], last["comm"]["pp_recv"]
    assert first["pp_micro_batches"] > 0  # some steps went as micro-batches: one send each
    assert sends["calls"] == recvs["calls"] > first["num_steps"]
    assert sends["bytes"] == recvs["bytes"] == payload  # micro-batches split the rows, not add to them
    assert "pp_recv" not in first["comm"] and "pp_send" not in last["comm"]  # the last stage sends nothing
    assert "all_reduce" not in first["comm"]  # tp=1 stages: no collectives
    assert first["pp_bytes"] == payload
