"""Greedy output must equal HF transformers token for token (fp32), whatever the batch
composition, pool pressure (preemption) or token budget (chunked prefill). HF is consulted by
teacher forcing (checkpoints.HFGreedyReference): equivalent to comparing with HF's generate,
at one forward per prompt."""
from __future__ import annotations

import random

import pytest

from checkpoints import HFGreedyReference, make_checkpoint
from pagedserve import LLM, SamplingParams
from pagedserve.core.scheduler import PreemptionCosts

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
    # A third of the prompts share a 70-token system prompt, so prefix caching has hits.
    system = [rng.randrange(2, 384) for _ in range(70)]
    for i in range(6, NUM_PROMPTS, 3):
        prompts[i] = (system + prompts[i])[:400]
    max_tokens = [rng.randint(1, 40) for _ in lengths]
    return prompts, max_tokens


_CASES: dict = {}


def _case(arch, tmp_path_factory):
    """Checkpoint + HF reference, built once per architecture for the whole module."""
    if arch not in _CASES:
        path = make_checkpoint(tmp_path_factory.mktemp(arch), arch, **ARCHS[arch])
        prompts, max_tokens = make_workload()
        _CASES[arch] = (arch, path, prompts, max_tokens, Reference(HFGreedyReference(path), prompts, max_tokens))
    return _CASES[arch]


class Reference:
    def __init__(self, hf: HFGreedyReference, prompts, max_tokens) -> None:
        self.hf, self.prompts, self.max_tokens = hf, prompts, max_tokens


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_case(request, tmp_path_factory):
    return _case(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory):
    """The full mode x caching matrix runs on Llama; the other architectures get one
    representative run of each mechanism (their differences are in the model, not the core)."""
    return _case("llama", tmp_path_factory)


def run(path, prompts, max_tokens, priority=None, before=None, **engine_args):
    llm = LLM(str(path), max_model_len=512, **engine_args)
    if before is not None:
        before(llm)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks
    return [o.outputs[0].token_ids for o in outs], llm.engine.scheduler


def force_auto_choice(mode: str):
    """For preemption_mode=auto: costs under which every victim's cheaper path is `mode`, so the
    test knows which path ran instead of depending on measured timings. (The one place that
    knows where the engine keeps its PreemptionCosts.)"""
    def apply(llm) -> None:
        bandwidth = float("inf") if mode == "swap" else 1e-30  # a free or a hopeless host copy
        costs = PreemptionCosts(bytes_per_block=llm.engine.pool_sizing.bytes_per_block, host_bandwidth=bandwidth,
                                prefill_seconds_per_token=1e-6)
        llm.engine.preemption_costs = llm.engine.scheduler.costs = costs
    return apply


def assert_same(got, ref: Reference):
    assert len(got) == len(ref.prompts)
    for i, (g, prompt, n) in enumerate(zip(got, ref.prompts, ref.max_tokens)):
        assert len(g) == n, f"prompt {i}: {len(g)} tokens, want {n}"
        j = ref.hf.first_divergence(prompt, g)
        assert j is None, f"prompt {i}: token {j} is not HF's greedy choice"


def assert_prefix_caching(sched, enabled: bool):
    if enabled:
        assert sched.kv.prefix_hits > 0, "prefix caching is on but no prompt token was served from cache"
    else:
        assert sched.kv.prefix_hits == 0


# Each mechanism alone once, then preemption modes each with one caching setting: the
# all-at-once runs below cover their combination, so the full mode x caching product is not run.
def test_roomy_pool_with_prefix_caching(llama_case):
    _, path, prompts, max_tokens, ref = llama_case
    got, sched = run(path, prompts, max_tokens, num_kv_blocks=1024, max_num_batched_tokens=1024,
                     enable_prefix_caching=True)
    assert sched.total_preemptions == 0
    assert_prefix_caching(sched, True)
    assert_same(got, ref)


def test_every_mechanism_at_once(arch_case):
    """Preemption (auto), prefix caching and chunked prefill together, per architecture."""
    _, path, prompts, max_tokens, ref = arch_case
    got, sched = run(path, prompts, max_tokens, num_kv_blocks=40, max_num_batched_tokens=96,
                     preemption_mode="auto", enable_prefix_caching=True, swap_space="64MiB")
    assert sched.total_preemptions > 0 and sched.total_partial_prefills > 0
    assert_prefix_caching(sched, True)
    assert_same(got, ref)


@pytest.mark.parametrize("mode,auto_choice,caching", [
    ("recompute", None, True), ("swap", None, False),
    ("auto", "swap", True), ("auto", "recompute", False),
])
def test_preemption(llama_case, mode, auto_choice, caching):
    _, path, prompts, max_tokens, ref = llama_case
    # 40 blocks = 640 tokens for 24 prompts of up to 440 tokens: the pool runs dry often.
    got, sched = run(path, prompts, max_tokens, num_kv_blocks=40, max_num_batched_tokens=1024,
                     preemption_mode=mode, enable_prefix_caching=caching, swap_space="64MiB",
                     before=force_auto_choice(auto_choice) if auto_choice else None)
    by_mode = sched.total_preemptions_by_mode
    ran = auto_choice or mode
    assert sched.total_preemptions > 0
    if ran == "recompute":
        assert by_mode["swap"] == 0 and sched.total_recomputed_tokens > 0
    if ran == "swap":  # the host pool (8192 blocks) never fills: no fallback to recompute
        assert by_mode["recompute"] == 0 and sched.total_blocks_swapped["in"] > 0
    assert sched.total_blocks_swapped["in"] == sched.total_blocks_swapped["out"]
    assert sched.kv.host_pool is None or sched.kv.host_pool.num_free_blocks == sched.kv.host_pool.num_blocks
    assert_same(got, ref)


def test_swap_falls_back_to_recompute_when_host_pool_is_full(llama_case):
    _, path, prompts, max_tokens, ref = llama_case
    # 2 host blocks cannot hold most victims, so most preemptions must recompute.
    got, sched = run(path, prompts, max_tokens, num_kv_blocks=40, max_num_batched_tokens=1024,
                     preemption_mode="swap", swap_space=2 * 16 * 2 * 2 * 2 * 16 * 4 * 2)
    assert sched.total_preemptions_by_mode["recompute"] > 0
    assert_same(got, ref)


def test_chunked_prefill(llama_case):
    _, path, prompts, max_tokens, ref = llama_case
    got, sched = run(path, prompts, max_tokens, num_kv_blocks=1024, max_num_batched_tokens=64, max_num_seqs=8,
                     enable_prefix_caching=False)
    assert sched.total_partial_prefills > 0 and sched.total_preemptions == 0
    assert_prefix_caching(sched, False)
    assert_same(got, ref)


def test_no_chunking_whole_prompts(arch_case):
    _, path, prompts, max_tokens, ref = arch_case
    got, sched = run(path, prompts, max_tokens, num_kv_blocks=1024, enable_chunked_prefill=False,
                     max_num_batched_tokens=512)
    assert sched.total_partial_prefills == 0
    assert_same(got, ref)


def test_long_prefill_threshold_and_priority(llama_case):
    """Real priorities (not all 0): requests overtake and are preempted out of arrival order,
    and the output is still HF's. (The order itself is checked in test_scheduler_policy.)"""
    _, path, prompts, max_tokens, ref = llama_case
    priority = [random.Random(i).randrange(4) for i in range(len(prompts))]
    got, sched = run(path, prompts, max_tokens, priority=priority, num_kv_blocks=40, max_num_batched_tokens=1024,
                     long_prefill_token_threshold=48, scheduling_policy="priority")
    assert len(set(priority)) == 4
    assert sched.total_partial_prefills > 0 and sched.total_preemptions > 0
    assert_same(got, ref)
