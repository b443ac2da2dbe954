"""The serving layer by endpoint, its per-step delivery work, and vLLM's async scheduling in the
simulator (benchmarks/serving_endpoint_probe.py measured the terms; sim/host_overhead.py reads them)."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from pagedserve.bench.workloads import WorkloadRequest
from pagedserve.config import EngineConfig
from pagedserve.sim import host_overhead as ho
from pagedserve.sim.cost_model import CostParams
from pagedserve.sim.executor import SimExecutor
from pagedserve.sim.host_overhead import ServingOverhead
from pagedserve.sim.serving_loop import HeapSends, ServingLoop
from pagedserve.sim.simulator import build_deployment, simulate


def _dep(**kw):
    return build_deployment(EngineConfig(max_num_seqs=64, max_model_len=4096), "llama-3.1-8b", gpu="H100-SXM", **kw)


@pytest.mark.parametrize("profile,path", [("pagedserve", ho.DEFAULTS_PATH), ("vllm", ho.VLLM_SERVING_PATH)])
def test_the_chat_endpoint_charges_the_chat_terms_measured_for_it(profile, path):
    """One request alone: its TTFT on /v1/chat/completions less its TTFT on /v1/completions is the
    difference of the two endpoints' terms in the shipped measurement (admission, its tokenizer
    part, and the first token's delivery), the device's work being the same."""
    fit = json.loads(path.read_text())["fit"]
    chat = fit["chat"]
    p = 128
    want = sum(chat.get(k, 0.0) - fit.get(k, 0.0) for k in ("admit_s", "deliver_s", "deliver_step_s",
                                                             "deliver_per_output_s"))
    want += (chat["admit_per_prompt_token_s"] - fit["admit_per_prompt_token_s"]) * p
    ttft = {}
    for endpoint in ("completions", "chat"):
        dep = _dep(host_profile=profile, endpoint=endpoint)
        m = simulate(dep, [WorkloadRequest([100] * p, None, p, 4, 0.0)]).metrics
        ttft[endpoint] = m["mean_ttft_ms"] / 1e3
    if profile == "vllm":
        assert want > 0.0  # vLLM's chat path measured dearer (pagedserve's: no difference measured)
    assert ttft["chat"] - ttft["completions"] == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_a_profile_without_chat_terms_refuses_the_chat_endpoint():
    with pytest.raises(ValueError, match="chat"):
        ho.HostOverhead(admit_s=1e-3).for_endpoint("chat")


def test_a_steps_delivery_occupies_the_loop_once_per_step_then_per_stream():
    """deliver_step_s is loop work per step (vLLM's output handler takes one engine message per
    step), deliver_per_output_s per stream fed, deliver_s latency on top that occupies nothing."""
    s = ServingOverhead(deliver_s=2e-3, deliver_per_output_s=1e-4, deliver_step_s=1e-3, serial=True)
    loop = ServingLoop(s)
    sends = HeapSends()
    first = loop.deliver(sends, 1.0, 10)          # 1.0 + 1 ms + 10 x 0.1 ms, then 2 ms of latency
    assert first == pytest.approx(1.004)
    second = loop.deliver(sends, 1.0005, 10)      # the loop is busy until 1.002: it starts then
    assert second == pytest.approx(1.002 + 0.002 + 0.002)


def _step(n_decodes: int, ctx: int):
    sched = [SimpleNamespace(token_ids=[7], start_pos=ctx - 1, sample=True, request_id=str(i))
             for i in range(n_decodes)]
    return SimpleNamespace(scheduled=sched, is_empty=False, num_batched_tokens=n_decodes, blocks_to_swap_out=[],
                           blocks_to_swap_in=[])


def test_async_scheduling_hides_the_steps_host_work_under_the_device():
    """With async scheduling the step takes max(device, host), without it their sum; the host part
    is the cost model's per-step terms, by hand."""
    sync = _dep(host_profile="vllm", async_scheduling=False)
    over = _dep(host_profile="vllm", async_scheduling=True)
    assert not sync.cost_model.params.host_overlap and over.cost_model.params.host_overlap
    p = sync.cost_model.params
    for n, ctx in ((1, 200), (32, 1000), (256, 3000)):
        out = _step(n, ctx)
        host = p.step_overhead_s + p.per_request_overhead_s * n + p.per_token_overhead_s * n
        t_sync = SimExecutor(sync.cost_model).step_duration(out)
        t_over = SimExecutor(over.cost_model).step_duration(out)
        assert host > 0
        assert t_over == pytest.approx(max(t_sync - host, host))
    # a host slower than the device: the step is the host's
    over.cost_model.params.step_overhead_s = 1.0
    assert SimExecutor(over.cost_model).step_duration(_step(1, 200)) == pytest.approx(
        1.0 + p.per_request_overhead_s + p.per_token_overhead_s)
    assert math.isclose(SimExecutor(_dep().cost_model).step_duration(_step(1, 200)),
                        SimExecutor(_dep(async_scheduling=False).cost_model).step_duration(_step(1, 200)))


def test_the_vllm_profile_runs_the_measured_v1_engine_loop_with_async_scheduling():
    """The shipped vLLM file's engine loop (vllm_engine_step_probe.py), not the v0.6 blog's figure,
    with async scheduling on unless asked off."""
    loop = json.loads(ho.VLLM_SERVING_PATH.read_text())["fit"]["engine_loop"]
    v = ho.default_host_overhead(profile="vllm")
    assert (v.step_s, v.per_request_s) == (loop["step_s"], loop["per_request_s"]) and v.step_s != ho.VLLM_STEP_S
    assert v.async_scheduling and "vllm_engine_step_probe.py" in v.source
    assert not ho.default_host_overhead(profile="vllm", async_scheduling=False).async_scheduling
    assert not ho.default_host_overhead().async_scheduling  # pagedserve's engine: no async scheduling


def test_outputs_that_queue_behind_the_frames_being_written_go_out_with_them():
    """merge_outputs (vLLM's API process merges a stream's queued outputs): a step that ends while
    the step before's frames are still being written costs the loop its per-step work only, and its
    tokens reach the clients just after those frames; without it, a frame per stream again."""
    kw = dict(deliver_per_output_s=1e-3, deliver_step_s=1e-4, serial=True)
    merged, plain = ServingLoop(ServingOverhead(merge_outputs=True, **kw)), ServingLoop(ServingOverhead(**kw))
    sends = HeapSends()
    for loop in (merged, plain):
        assert loop.deliver(sends, 1.0, 10) == pytest.approx(1.0101)
    assert merged.deliver(sends, 1.005, 10) == pytest.approx(1.0102)
    assert plain.deliver(sends, 1.005, 10) == pytest.approx(1.0202)
    assert merged.deliver(sends, 1.05, 10) == pytest.approx(1.0601)  # the loop caught up: frames again


def test_both_host_profiles_merge_a_streams_queued_outputs():
    """pagedserve's server merges a stream's queued outputs into one chunk (issue 32), as vLLM's does:
    both profiles hand the simulator's serving loop merge_outputs."""
    for profile in ("pagedserve", "vllm"):
        p = CostParams(peak_flops=1e12, mem_bandwidth=1e11)
        ho.default_host_overhead(profile=profile).apply(p)
        assert ServingOverhead.from_dict(p.serving).merge_outputs, profile


def test_the_hand_over_after_the_tokenizer_await_is_loop_work_in_turn():
    """handover_s (vLLM's add_request: input processing and the send to the engine core) runs on the
    loop after the tokenizer: in a burst of 3 with 1 s of parse each and 0.5 s of hand-over, the parses
    take the loop to 3 s, then the hand-overs go one after another: in the engine at 3.5 / 4 / 4.5 s,
    by hand (without it, all three at 3 s)."""
    def entries(handover_s):
        loop = ServingLoop(ServingOverhead(admit_s=1.0, handover_s=handover_s, serial=True, tokenize_off_loop=True))
        sends = HeapSends()
        for key in range(3):
            sends.push(0.0, key, 10)
        loop.admit(sends, 10.0)
        return [t for t, _ in loop.entered(10.0)]

    assert entries(0.5) == pytest.approx([3.5, 4.0, 4.5])
    assert entries(0.0) == pytest.approx([3.0, 3.0, 3.0])
    assert ServingOverhead(admit_s=1.0, admit_per_prompt_token_s=0.01, handover_s=0.5).admit(10) == pytest.approx(1.6)
