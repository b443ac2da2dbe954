"""Issue 31: the simulator's host CPU terms, mixed steps, fp8, the new GPU presets, the serving
layer as one event loop, and the swap probe of calibration. Arithmetic checked by hand."""
from __future__ import annotations

import json

import pytest

from pagedserve.bench.workloads import WorkloadRequest
from pagedserve.config import EngineConfig
from pagedserve.plan.gpus import get_gpu
from pagedserve.plan.kv_budget import ModelShape
from pagedserve.sim.cost_model import CostModel, CostParams, ModelCost, ServingOverhead, fit, step_features
from pagedserve.sim.host_overhead import VLLM_SERVING_PATH, HostOverhead, default_host_overhead
from pagedserve.sim.simulator import build_deployment, simulate

SHAPE = ModelShape(num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=1, head_dim=4,
                   intermediate_size=16, vocab_size=10)


def unit_params(**kw) -> CostParams:
    base = dict(peak_flops=1000.0, mem_bandwidth=100.0, gemm_mfu=1.0, gemm_mbu=1.0, attn_mfu=1.0, attn_mbu=1.0,
                step_overhead_s=0.0, per_request_overhead_s=0.0)
    base.update(kw)
    return CostParams(**base)


# -- GPU presets --------------------------------------------------------------------------------
@pytest.mark.parametrize("name, bf16, fp8, hbm", [("L4", 121, 242.5, 300), ("B200", 2250, 4500, 8000),
                                                   ("GH200", 989, 1979, 4000), ("MI300X", 1307.4, 2614.9, 5300),
                                                   ("H100-SXM", 989, 1979, 3350), ("A100-80GB", 312, 0, 2039)])
def test_presets_carry_datasheet_peaks_and_their_source(name, bf16, fp8, hbm):
    spec = get_gpu(name)
    assert (spec.bf16_tflops, spec.fp8_tflops, spec.hbm_bandwidth_gbps) == (bf16, fp8, hbm)
    assert spec.source.startswith("https://")
    p = CostParams.for_gpu(spec)
    assert p.fp8_peak_flops == fp8 * 1e12


def test_gh200_swaps_over_nvlink_c2c():
    # 900 GB/s NVLink-C2C bidirectional: 450 GB/s one way to the Grace host, vs 64 over PCIe 5
    assert get_gpu("GH200").host_link_gbps == 450
    assert get_gpu("gh200-96gb").name == "GH200"


# -- fp8 ----------------------------------------------------------------------------------------
def test_fp8_weights_run_their_gemms_at_the_fp8_peak():
    p = unit_params(fp8_peak_flops=4000.0)
    bf16 = ModelCost.from_shape(SHAPE, "bfloat16", None, 1)
    fp8 = ModelCost.from_shape(SHAPE, "fp8", None, 1)
    assert fp8.weight_bytes_per_rank == bf16.weight_bytes_per_rank / 2
    new, ctx = [500], [500]  # a big prefill: compute-bound
    f = step_features(fp8, new, ctx)
    t = CostModel(fp8, p).breakdown(f)
    assert t.linear == pytest.approx(f.linear_flops / 4000.0)  # not / 1000 (the bf16 peak)
    assert CostModel(bf16, p).breakdown(step_features(bf16, new, ctx)).linear == pytest.approx(f.linear_flops / 1000.0)
    # a device without fp8 tensor cores (A100: weight-only fp8) computes at its bf16 peak
    assert CostModel(fp8, unit_params()).breakdown(f).linear == pytest.approx(f.linear_flops / 1000.0)


def test_simulate_takes_fp8_weights_on_a_gpu_preset():
    # 70B in fp8 fits one H100 (the bf16 checkpoint would not): the plan sizes the pool at 1 byte/weight
    dep = build_deployment(EngineConfig(max_num_seqs=8, max_model_len=2048, enable_chunked_prefill=False),
                           "llama-3.1-70b", gpu="H100-SXM", weight_dtype="fp8")
    assert dep.num_blocks > 128
    assert dep.cost_model.model.weight_bytes_per_param == 1
    assert dep.cost_model.params.fp8_peak_flops == 1979e12


def test_gemms_run_at_the_chips_measured_matmul_share_of_its_datasheet():
    # MAMF (stas00/ml-engineering): H100 794.5 / 989 bf16 and 1402.6 / 1979 fp8 are the reference the
    # GEMM MFU was stated on; MI300X reaches 668.4 of 1307.4 bf16 and 1222.9 of 2614.9 fp8 (hipBLASLt,
    # Azure ND MI300X v5); H200's fp8 was measured on H200 (1453.4); a chip with bf16 measured and fp8 not
    # (A100 has no fp8 cores; a custom spec below) lets its bf16 share stand in
    from pagedserve.sim.cost_params import matmul_share

    assert matmul_share(get_gpu("H100-SXM"), "bf16") == 1.0 and matmul_share(get_gpu("H100-SXM"), "fp8") == 1.0
    mi300x = (668.4 / 1307.4) / (794.5 / 989)
    assert matmul_share(get_gpu("MI300X"), "bf16") == pytest.approx(mi300x)
    mi300x_fp8 = (1222.9 / 2614.9) / (1402.6 / 1979)
    assert matmul_share(get_gpu("MI300X"), "fp8") == pytest.approx(mi300x_fp8)
    from dataclasses import replace
    assert matmul_share(replace(get_gpu("MI300X"), matmul_fp8_tflops=0.0), "fp8") == pytest.approx(mi300x)
    assert matmul_share(get_gpu("H200"), "fp8") == pytest.approx(1453.4 / 1402.6)
    assert matmul_share(get_gpu("L4"), "bf16") == 1.0  # nobody measured it: the datasheet as before
    # a compute-bound prefill's GEMMs on the MI300X preset: datasheet x share x MFU, bf16 and fp8 alike
    p = CostParams.for_gpu(get_gpu("MI300X"))
    assert p.peak_flops == 1307.4e12 and p.fp8_peak_flops == 2614.9e12  # the datasheet is kept as such
    for dtype, peak, share in (("bfloat16", 1307.4e12, mi300x), ("fp8", 2614.9e12, mi300x_fp8)):
        m = ModelCost.from_shape(SHAPE, dtype, None, 1)
        f = step_features(m, [4000], [4000])
        assert CostModel(m, p).breakdown(f).linear == pytest.approx(f.linear_flops / (peak * share * p.gemm_mfu))


# -- mixed steps --------------------------------------------------------------------------------
def test_mixed_step_adds_the_chunks_and_the_decodes_attention():
    m = ModelCost.from_shape(SHAPE, "bfloat16", None, 1)
    per_pair = 4 * 2 * 2 * 4  # 4 x layers x heads x head_dim
    new, ctx = [100, 1, 1], [100, 400, 600]
    f = step_features(m, new, ctx)
    chunk_f, chunk_b = per_pair * (100 * 101 // 2) / 1000.0, 100 * 32 / 100.0  # compute-bound
    dec_f, dec_b = per_pair * 1000 / 1000.0, 1000 * 32 / 100.0                  # memory-bound
    t = CostModel(m, unit_params()).breakdown(f)
    assert t.attention == pytest.approx(max(chunk_f, chunk_b) + max(dec_f, dec_b))
    # what a single max() over the step's totals gave: the chunk hidden behind the decodes' read
    assert t.attention > max(chunk_f + dec_f, chunk_b + dec_b)
    # a decode-only or prefill-only step is one roofline, as before
    only = CostModel(m, unit_params()).breakdown(step_features(m, [1, 1], [400, 600]))
    assert only.attention == pytest.approx(max(dec_f, dec_b))


def test_max_form_fit_recovers_a_split_roofline():
    import random

    m = ModelCost.from_shape(SHAPE, "float32", None, 1)
    rng = random.Random(1)
    from pagedserve.core.engine_core import StepTrace

    def by_hand(new, ctx):  # GEMM roofline + the chunks' and the decodes' attention each at its bound
        f = step_features(m, new, ctx)
        gemm = max(f.linear_flops / (1000 * 0.3), f.linear_bytes / (100 * 0.8))
        dec = max(f.attn_decode_flops / (1000 * 0.2), f.attn_decode_bytes / (100 * 0.5))
        chunks = max((f.attn_flops - f.attn_decode_flops) / (1000 * 0.2),
                     (f.attn_bytes - f.attn_decode_bytes) / (100 * 0.5))
        return 0.05 + 0.02 * len(new) + gemm + dec + chunks

    records = []
    for _ in range(300):
        new = [rng.choice([1, 1, rng.randint(2, 400)]) for _ in range(rng.randint(1, 8))]
        ctx = [k + rng.randint(0, 900) for k in new]
        records.append(StepTrace(new_tokens=new, context_lens=ctx, duration=by_hand(new, ctx)))
    params, report = fit(records, m, unit_params())
    assert report["mean_abs_rel_error"] < 0.01
    assert params.attn_mbu == pytest.approx(0.5, rel=0.1)


# -- host CPU terms on GPU presets ------------------------------------------------------------
def test_gpu_presets_model_the_host_by_default_and_only_drop_the_serving_layer_when_asked():
    cfg = dict(max_num_seqs=8, max_model_len=2048)
    dep = build_deployment(EngineConfig(**cfg), "llama-3.1-8b", gpu="L4")
    serving = ServingOverhead.from_dict(dep.cost_model.params.serving)
    assert not serving.is_zero and serving.serial
    assert "none modelled" not in serving.describe()
    host = default_host_overhead()
    # the engine loop: the scheduler's terms plus the model runner's input preparation
    assert dep.cost_model.params.step_overhead_s == pytest.approx(host.step_s + host.runner_step_s)
    assert dep.cost_model.params.per_token_overhead_s == pytest.approx(host.per_token_s + host.runner_per_token_s)
    off = build_deployment(EngineConfig(**cfg), "llama-3.1-8b", gpu="L4", serving_overhead=False)
    assert ServingOverhead.from_dict(off.cost_model.params.serving).is_zero
    assert off.cost_model.params.step_overhead_s == pytest.approx(host.engine_step_s)  # the engine loop stays
    fast = build_deployment(EngineConfig(**cfg), "llama-3.1-8b", gpu="L4", host_cpu_speed=2.0)
    assert fast.cost_model.params.step_overhead_s == pytest.approx(host.engine_step_s / 2)
    assert ServingOverhead.from_dict(fast.cost_model.params.serving).admit_s == pytest.approx(host.admit_s / 2)
    vllm = build_deployment(EngineConfig(**cfg), "llama-3.1-8b", gpu="L4", host_profile="vllm")
    # vLLM's V1 engine loop as measured (host_overhead_vllm.json), overlapped with the device
    loop = json.loads(VLLM_SERVING_PATH.read_text())["fit"]["engine_loop"]
    assert vllm.cost_model.params.step_overhead_s == pytest.approx(loop["step_s"])
    assert vllm.cost_model.params.host_overlap and not dep.cost_model.params.host_overlap


def test_host_overhead_terms_by_hand():
    h = HostOverhead(step_s=1e-3, per_request_s=1e-5, per_token_s=1e-6, admit_s=2e-3, admit_per_prompt_token_s=1e-6,
                     deliver_s=0.0, deliver_per_output_s=5e-5)
    p = unit_params()
    h.scaled(4.0).apply(p)
    terms = (p.step_overhead_s, p.per_request_overhead_s, p.per_token_overhead_s)
    assert terms == pytest.approx((2.5e-4, 2.5e-6, 2.5e-7))
    s = ServingOverhead.from_dict(p.serving)
    assert s.admit(1000) == pytest.approx((2e-3 + 1e-3) / 4)
    m = ModelCost.from_shape(SHAPE, "bfloat16", None, 1)
    base = CostModel(m, unit_params()).breakdown(step_features(m, [100, 1, 1], [100, 400, 600]))
    with_host = CostModel(m, p).breakdown(step_features(m, [100, 1, 1], [100, 400, 600]))
    assert with_host.overhead - base.overhead == pytest.approx(2.5e-4 + 3 * 2.5e-6 + 102 * 2.5e-7)
    with pytest.raises(ValueError, match="host_cpu_speed"):
        h.scaled(0)


def test_the_model_runners_input_preparation_joins_the_engine_loop_except_under_vllms_figure():
    h = HostOverhead(step_s=1e-5, per_request_s=3e-6, per_token_s=5e-8, runner_step_s=2e-4,
                     runner_per_request_s=5e-6, runner_per_token_s=6e-7)
    p = unit_params()
    h.scaled(2.0).apply(p)
    assert (p.step_overhead_s, p.per_request_overhead_s, p.per_token_overhead_s) == \
        pytest.approx((2.1e-4 / 2, 8e-6 / 2, 6.5e-7 / 2))
    v = unit_params()
    h.for_profile("vllm").apply(v)  # vLLM's measured V1 loop is its whole loop, input preparation included
    loop = json.loads(VLLM_SERVING_PATH.read_text())["fit"]["engine_loop"]
    assert (v.step_overhead_s, v.per_request_overhead_s, v.per_token_overhead_s) == pytest.approx(
        (loop["step_s"], loop["per_request_s"], 0.0))
    old = HostOverhead.from_dict({"step_s": 1e-5, "source": "host_probe on X"})  # a file from before
    assert old.runner_step_s == 0.0 and old.engine_step_s == 1e-5


def test_host_probe_times_the_model_runners_host_side():
    from pagedserve.sim.host_probe import fit_runner, runner_steps

    rows = runner_steps(batches=(1, 4), chunks=(0, 32), steps=4)
    assert [(r, t) for r, t, _ in rows] == [(1, 1), (2, 33), (4, 4), (5, 36)]
    assert all(s > 0 for *_, s in rows)
    # the fit recovers terms set by hand
    truth = [(r, t, 2e-4 + 5e-6 * r + 6e-7 * t) for r, t in ((1, 1), (2, 65), (8, 8), (9, 264), (64, 64), (65, 320))]
    (step, per_req, per_tok), err = fit_runner(truth)
    assert (step, per_req, per_tok) == pytest.approx((2e-4, 5e-6, 6e-7), rel=1e-6)
    assert err < 1e-9


# -- the serving layer as one event loop ---------------------------------------------------------
def _cpu_dep(tmp_path, serving: ServingOverhead):
    from test_sim import cpu_params, write_config

    params = cpu_params()
    params.serving = serving.to_dict()
    return build_deployment(EngineConfig(num_kv_blocks=256, max_model_len=256, max_num_seqs=16),
                            str(write_config(tmp_path / "m")), cost_params=params)


def test_a_burst_queues_at_a_serial_serving_layer(tmp_path):
    burst = [WorkloadRequest(None, None, 40, 3, arrival_time=0.0) for _ in range(6)]
    admit = dict(admit_s=0.1, admit_per_prompt_token_s=0.0)
    apart = simulate(_cpu_dep(tmp_path, ServingOverhead(**admit)), burst)
    queued = simulate(_cpu_dep(tmp_path, ServingOverhead(**admit, serial=True)), burst)
    ttft_apart = sorted(r.ttft for r in apart.records)
    ttft_queued = sorted(r.ttft for r in queued.records)
    # served at once, every request is admitted 0.1 s after it was sent; one loop takes them in turn
    assert all(t >= 0.1 for t in ttft_apart) and ttft_apart[-1] < 0.1 + 1.0
    for k, t in enumerate(ttft_queued):
        assert t >= 0.1 * (k + 1) - 1e-9
    assert all(r.finish is not None for r in queued.records)  # none lost, none stuck


def test_one_loop_takes_turns_a_bursts_admissions_do_not_hold_the_first_streams_tokens(tmp_path):
    # 6 requests at once, 0.1 s of the loop's work each to admit, 0.01 s per step's delivery: the
    # loop alternates (an asyncio loop runs its ready callbacks in turn), so the first stream gets
    # its tokens while the other five are still being admitted, not after the last admission at 0.6 s
    burst = [WorkloadRequest(None, None, 40, 3, arrival_time=0.0) for _ in range(6)]
    res = simulate(_cpu_dep(tmp_path, ServingOverhead(admit_s=0.1, deliver_per_output_s=0.01, serial=True)), burst)
    first = min(res.records, key=lambda r: r.ttft)
    assert first.ttft < 0.1 + 0.1 + 0.05  # its admission, at most one more admission's turn, a step and a delivery
    assert first.token_times[0] < 0.5
    ttfts = sorted(r.ttft for r in res.records)
    for k, t in enumerate(ttfts):  # still one loop: the k-th admission ends no earlier than (k + 1) x 0.1 s
        assert t >= 0.1 * (k + 1) - 1e-9
    assert all(r.finish is not None for r in res.records)


def test_admissions_shorter_than_a_step_follow_one_another_during_it(tmp_path):
    # 0.5 ms per admission, steps of ~2 ms: the loop admits the six back to back while the engine
    # steps (it does not wait for a step's end to take the next one), so all six are in the engine
    # within 3 ms and have a first token within two steps after that
    burst = [WorkloadRequest(None, None, 40, 20, arrival_time=0.0) for _ in range(6)]
    res = simulate(_cpu_dep(tmp_path, ServingOverhead(admit_s=0.0005, deliver_per_output_s=0.0001, serial=True)),
                   burst)
    first = min(res.records, key=lambda r: r.ttft)
    step = max(b - a for a, b in zip(first.token_times, first.token_times[1:]))
    assert max(r.ttft for r in res.records) <= 6 * 0.0005 + 2 * step + 1e-9


def test_a_split_admission_parses_the_burst_before_the_first_hand_over(tmp_path):
    # 3 requests at t=0; 1 s of the loop's work each (parse, validate) and 40 x 25 ms = 1 s on the
    # tokenizer thread. By hand: parses 0-1, 1-2, 2-3 on the loop; tokenizations 1-2, 2-3, 3-4 on
    # the thread; the first hand-over is ready at 2 but the third parse was ready first (at 0), so
    # the loop takes it up at 3, the second at 3, the third at 4: in the engine at 3, 3, 4 s, and
    # the loop is free when their prefill steps end. One block each (no split): admissions 0-2,
    # 2-4, 4-6, and the first stream's step ends inside the second admission, so its token waits
    # for the loop until 4, the second's until 6, the third is delivered at once: 4, 6, 6.
    burst = [WorkloadRequest(None, None, 40, 2, arrival_time=0.0) for _ in range(3)]
    terms = dict(admit_s=1.0, admit_per_prompt_token_s=0.025, serial=True)
    split = simulate(_cpu_dep(tmp_path, ServingOverhead(**terms, tokenize_off_loop=True)), burst)
    block = simulate(_cpu_dep(tmp_path, ServingOverhead(**terms)), burst)
    for res, entries in ((split, [3.0, 3.0, 4.0]), (block, [4.0, 6.0, 6.0])):
        ttfts = sorted(r.ttft for r in res.records)
        for t, entry in zip(ttfts, entries):  # then its prefill step (milliseconds here)
            assert entry <= t < entry + 0.05
        assert all(r.finish is not None for r in res.records)


def test_serial_delivery_work_spaces_a_streams_tokens_and_its_latency_does_not(tmp_path):
    many = [WorkloadRequest(None, None, 20, 6, arrival_time=0.0) for _ in range(4)]
    busy = simulate(_cpu_dep(tmp_path, ServingOverhead(deliver_per_output_s=0.05, serial=True)), many)
    for rec in busy.records:  # 4 streams x 0.05 s of the loop's work per step: 0.2 s between tokens
        gaps = [b - a for a, b in zip(rec.token_times, rec.token_times[1:])]
        assert all(g >= 0.2 - 1e-9 for g in gaps)
    late = simulate(_cpu_dep(tmp_path, ServingOverhead(deliver_s=0.05, serial=True)), many)
    plain = simulate(_cpu_dep(tmp_path, ServingOverhead()), many)
    for a, b in zip(plain.records, late.records):  # a hand-over latency shifts every token, queues nothing
        assert b.token_times == pytest.approx([t + 0.05 for t in a.token_times])


# -- calibration: the swap probe ------------------------------------------------------------
def test_calibration_without_swaps_takes_the_host_copy_from_the_probe():
    from test_sim_calibration import cpu_truth, synthetic_steps

    m = ModelCost.from_shape(SHAPE, "float32", None, 1)
    steps = synthetic_steps(CostModel(m, cpu_truth()), wall_per_cpu=2.0)
    calls = []

    def probe():
        calls.append(1)
        return 4e9, 3e-4, "a probe"

    params, report = fit(steps, m, CostParams(peak_flops=1e6, mem_bandwidth=1e6, combine="sum"), swap_probe=probe)
    assert calls == [1]
    assert params.host_bandwidth == pytest.approx(4e9 / report["wall_per_cpu"])
    assert params.swap_step_overhead_s == pytest.approx(3e-4 * report["wall_per_cpu"])
    assert "a probe" in report["host_bandwidth"]
    # and the simulator charges it: a step that swaps 4 blocks pays the fixed part once plus the bytes
    cm = CostModel(m, params)
    moved = 4 * 16 * m.kv_bytes_per_token
    assert cm.breakdown(step_features(m, [1], [10], 4)).swap == pytest.approx(
        params.swap_step_overhead_s + moved / params.host_bandwidth)


def test_swap_probe_times_the_engines_block_copy():
    pytest.importorskip("torch")
    from pagedserve.sim.swap_probe import probe_swap_cost

    bw, per_step, how = probe_swap_cost(2 * 2 * 16 * 4, 2, 16, "float32", block_counts=(1, 8), repeats=2)
    assert bw > 0 and per_step >= 0 and "block copy" in how


def test_a_probe_run_on_the_host_replaces_the_shipped_terms(tmp_path):
    import json

    own = HostOverhead(step_s=1e-3, per_request_s=2e-5, admit_s=4e-3, deliver_per_output_s=1e-4,
                       source="host_probe on X")
    path = tmp_path / "host.json"
    path.write_text(json.dumps({"fit": own.to_dict(), "report": {}}))
    dep = build_deployment(EngineConfig(max_num_seqs=8, max_model_len=2048), "llama-3.1-8b", gpu="H100-SXM",
                           host_overhead=path)
    assert dep.cost_model.params.step_overhead_s == 1e-3
    assert ServingOverhead.from_dict(dep.cost_model.params.serving).admit_s == 4e-3


def test_the_shipped_host_terms_say_where_they_were_measured():
    host = default_host_overhead()
    assert host.source.startswith("host_probe on ")
    assert host.step_s > 0 and host.admit_s > 0 and host.deliver_per_output_s > 0
    assert host.runner_step_s > 0 and host.runner_per_request_s > 0 and "model runner" in host.source
    assert "engine loop: vLLM 0.32.0 V1 engine core" in default_host_overhead(profile="vllm").source
    with pytest.raises(ValueError, match="host_profile"):
        default_host_overhead(profile="sglang")
