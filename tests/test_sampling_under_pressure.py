"""Seeded sampling and n=2 survive preemption and chunked prefill: a request preempted by
recompute or swap, or prefilled in chunks, draws exactly the tokens it draws in a roomy pool
where nothing is preempted (its generator's state must not be reset or advanced twice)."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams

LENS = (40, 75, 110, 60, 95, 30)


def workload():
    prompts = [[(i * 29 + 7 * n) % 380 + 2 for i in range(n)] for n in LENS]
    params = []
    for k in range(len(LENS)):
        if k % 3 == 0:
            params.append(SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=100 + k, max_tokens=16,
                                         ignore_eos=True))
        elif k % 3 == 1:
            params.append(SamplingParams(temperature=0.8, top_k=40, seed=200 + k, max_tokens=16, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    return prompts, params


def run(path, **engine_args):
    llm = LLM(str(path), max_model_len=128, enable_prefix_caching=False, **engine_args)
    prompts, params = workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [[c.token_ids for c in o.outputs] for o in outs]
    preemptions = sum(m.num_preemptions for o in outs for m in o.metrics)
    return tokens, preemptions, preemptions_by_mode(llm)


def preemptions_by_mode(llm) -> dict[str, int]:
    """The one place that knows where the engine counts preemptions by mode."""
    return dict(llm.engine.scheduler.total_preemptions_by_mode)


@pytest.fixture(scope="module")
def roomy(tiny_llama):
    tokens, preemptions, _ = run(tiny_llama, num_kv_blocks=512, max_num_batched_tokens=1024)
    assert preemptions == 0
    assert all(len(c) == 2 for c in tokens[::3])
    assert all(a != b for a, b in (c for c in tokens[::3]))  # n=2 samples differ
    return tokens


@pytest.mark.parametrize("name,engine_args", [
    # 8 blocks of 16 for six requests of up to 126 tokens (eight sequences with n=2)
    ("recompute", dict(num_kv_blocks=8, max_num_batched_tokens=1024, preemption_mode="recompute")),
    ("swap", dict(num_kv_blocks=8, max_num_batched_tokens=1024, preemption_mode="swap", swap_space="16MiB")),
    ("chunked", dict(num_kv_blocks=512, max_num_batched_tokens=24)),
])
def test_seeded_samples_identical_to_a_roomy_pool(tiny_llama, roomy, name, engine_args):
    tokens, preemptions, by_mode = run(tiny_llama, **engine_args)
    if name == "recompute":
        assert preemptions > 0 and by_mode["recompute"] == preemptions
    if name == "swap":
        assert preemptions > 0 and by_mode["swap"] > 0
    if name == "chunked":
        assert preemptions == 0 and min(LENS) > engine_args["max_num_batched_tokens"]  # every prompt in chunks
    assert tokens == roomy
