"""DP attention + EP (-dp 2 --enable-expert-parallel, the DeepSeek pattern): two engine-core
processes, each with the whole attention and its own KV pool, the routed experts spread over
both (E / 2 each), tokens exchanged in every MoE layer over gloo. Greedy output equals HF
transformers token for token on tiny Mixtral, Qwen2-MoE and DeepSeek-V3 (MLA) checkpoints,
under chunked prefill and forced (swap) preemption, with requests on both cores and with one
core idle (it runs dummy MoE passes for the other's tokens, else the other would wait in the
exchange forever); each core's weights and KV pool are `pagedserve plan`'s per-GPU bytes for
-dp 2 --enable-expert-parallel; a layout the experts cannot be spread by is refused, with
the numbers, before any process starts.

One server per architecture (two core processes each), built once per module.
"""
from __future__ import annotations

import pytest

from checkpoints import HFGreedyReference, make_checkpoint, parity_workload
from test_data_parallel import BLOCK_SIZE, MAX_MODEL_LEN, _plan, assert_cores_hold_plans_bytes, generate, scrape, \
    start_dp_server

ARCHS = ("mixtral", "qwen2_moe", "deepseek_v3")
NUM_KV_BLOCKS = 12
EP_ARGS = dict(data_parallel_size=2, enable_expert_parallel=True, max_model_len=MAX_MODEL_LEN,
               max_num_batched_tokens=32, block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS,
               enable_prefix_caching=True, swap_space="16KiB", preemption_mode="swap", max_num_seqs=8)


@pytest.fixture(scope="module", params=ARCHS)
def ep(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    st = start_dp_server(path, **EP_ARGS)
    st.arch, st.path, st.ref = request.param, path, HFGreedyReference(path)
    yield st
    st.stop()
    st.async_engine.shutdown()


def test_dp2_ep_matches_hf_under_chunking_swap_and_recompute_on_both_cores(ep):
    """A host swap pool of a few blocks: the same run swaps and, when the host pool is full,
    falls back to recompute (the cores are processes: the mode cannot change between runs)."""
    client = ep.async_engine.client
    placed_before, before = list(client.num_placed), scrape(ep)
    prompts, max_tokens = parity_workload(8, fixed_lengths=(1, 17, 150), seed=3)
    ep.ref.assert_greedy(prompts, generate(ep, prompts, max_tokens), max_tokens, f"{ep.arch} dp2+ep: ")
    placed = [n - b for n, b in zip(client.num_placed, placed_before)]
    assert min(placed) >= 2, placed
    after = scrape(ep)
    swapped = after['pagedserve:num_preemptions_total{mode="swap"}'] - before['pagedserve:num_preemptions_total{mode="swap"}']
    recomputed = after['pagedserve:num_preemptions_total{mode="recompute"}'] \
        - before.get('pagedserve:num_preemptions_total{mode="recompute"}', 0)
    assert swapped > 0 and recomputed > 0, (swapped, recomputed)


def test_one_busy_core_gets_its_experts_from_the_idle_one(ep):
    """One request: core 0 steps, core 1 has nothing and runs dummy MoE passes, computing its
    experts for core 0's tokens (without them the exchange would never complete)."""
    prompts, max_tokens = parity_workload(2, fixed_lengths=(40,), seed=5)
    ep.ref.assert_greedy(prompts[:1], generate(ep, prompts[:1], [6], timeout=120), [6], f"{ep.arch} one core: ")


def test_each_core_holds_the_weights_and_pool_plan_prints(ep):
    """Each core: attention, dense layers, shared experts, router and head whole, half the
    routed experts; a KV pool of plan's per-GPU bytes."""
    probe = _plan(ep.path, expert_parallel=True, kv_cache_memory=1 << 20)
    plan = _plan(ep.path, expert_parallel=True, kv_cache_memory=NUM_KV_BLOCKS * BLOCK_SIZE * probe.pool.bytes_per_token)
    assert plan.pool.num_blocks == NUM_KV_BLOCKS
    assert_cores_hold_plans_bytes(ep, plan)
    moe = ep.async_engine.engine.model_config.moe
    assert plan.stages[0].routed_experts_per_gpu == moe.num_experts // 2
    whole = _plan(ep.path, expert_parallel=False, kv_cache_memory=1 << 20).stages[0].weight_bytes
    assert plan.stages[0].weight_bytes < whole      # the experts really are split


@pytest.mark.parametrize("arch, shape, extra, needle", [
    ("mixtral", dict(num_local_experts=3), dict(enable_expert_parallel=True),
     "enable_expert_parallel: the expert-parallel size 2 (= data_parallel_size) does not divide the model's 3 experts"),
    ("llama", dict(), dict(enable_expert_parallel=True),
     "enable_expert_parallel: LlamaForCausalLM has no experts to spread"),
])
def test_a_layout_the_experts_cannot_be_spread_by_is_refused_before_any_process_starts(tmp_path, monkeypatch, arch,
                                                                                       shape, extra, needle):
    from pagedserve.engine import core_client

    def no_cores(*args, **kwargs):
        raise AssertionError("an engine core was started")

    monkeypatch.setattr(core_client.ProcessCoreClient, "__init__", no_cores)
    path = make_checkpoint(tmp_path / arch, arch, **shape)
    with pytest.raises(ValueError) as e:
        start_dp_server(path, data_parallel_size=2, max_model_len=64, num_kv_blocks=8, **extra)
    assert needle in str(e.value)
