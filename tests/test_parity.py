"""Greedy output must equal HF transformers token for token (fp32), whatever the batch
composition, pool pressure (preemption) or token budget (chunked prefill)."""
from __future__ import annotations

import random

import pytest

from checkpoints import hf_greedy, make_checkpoint
from pagedserve import LLM, SamplingParams

ARCHS = {
    "llama": dict(),                                   # GQA 4 heads / 2 kv heads
    "qwen2": dict(kv_heads=1),                         # qkv bias, tied embeddings, MQA
    "mistral": dict(kv_heads=2, sliding_window=48),    # sliding window shorter than the prompts
}
NUM_PROMPTS = 24


def make_workload(seed: int = 0):
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 400] + [rng.randint(1, 400) for _ in range(NUM_PROMPTS - 6)]
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in lengths]
    max_tokens = [rng.randint(1, 40) for _ in lengths]
    return prompts, max_tokens


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_case(request, tmp_path_factory):
    arch = request.param
    path = make_checkpoint(tmp_path_factory.mktemp(arch), arch, **ARCHS[arch])
    prompts, max_tokens = make_workload()
    return arch, path, prompts, max_tokens, hf_greedy(path, prompts, max_tokens)


def run(path, prompts, max_tokens, **engine_args):
    llm = LLM(str(path), max_model_len=512, **engine_args)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks
    return [o.outputs[0].token_ids for o in outs], llm.engine.scheduler


def assert_same(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i}: first divergence at token {next(j for j in range(len(w)) if j >= len(g) or g[j] != w[j])}"


def test_roomy_pool(arch_case):
    _, path, prompts, max_tokens, ref = arch_case
    got, sched = run(path, prompts, max_tokens, num_kv_blocks=1024, max_num_batched_tokens=4096)
    assert sched.total_preemptions == 0
    assert_same(got, ref)


def test_preemption(arch_case):
    _, path, prompts, max_tokens, ref = arch_case
    # 40 blocks = 640 tokens for 24 prompts of up to 440 tokens: the pool runs dry often.
    got, sched = run(path, prompts, max_tokens, num_kv_blocks=40, max_num_batched_tokens=1024)
    assert sched.total_preemptions > 0
    assert_same(got, ref)


def test_chunked_prefill(arch_case):
    _, path, prompts, max_tokens, ref = arch_case
    got, sched = run(path, prompts, max_tokens, num_kv_blocks=1024, max_num_batched_tokens=64, max_num_seqs=8)
    assert sched.total_partial_prefills > 0
    assert_same(got, ref)


def test_no_chunking_whole_prompts(arch_case):
    _, path, prompts, max_tokens, ref = arch_case
    got, sched = run(path, prompts, max_tokens, num_kv_blocks=1024, enable_chunked_prefill=False,
                     max_num_batched_tokens=512)
    assert sched.total_partial_prefills == 0
    assert_same(got, ref)
