"""Calibrating the simulator on a live server: the serving-overhead fit, the CPU-then-wall step
fit, the warnings for what a trace leaves unfitted, the simulator applying what was fitted,
the server's request trace, and `simulate --step-trace-path`. Synthetic traces are built from
known constants, so every fitted number is checked against the truth it came from."""
from __future__ import annotations

import json
import math
import random

import pytest

from pagedserve.bench.workloads import WorkloadRequest, make_workload, ramp_arrival_times
from pagedserve.config import EngineConfig
from pagedserve.core.engine_core import StepTrace
from pagedserve.plan.kv_budget import ModelShape
from pagedserve.sim.cost_model import (CostModel, CostParams, ModelCost, ServingOverhead, error_report, fit,
                                       fit_serving, match_client_records, run_beyond_coverage, step_costs,
                                       step_features)
from pagedserve.sim.host_overhead import SCATTER_QUANTILES, quantile_at, scatter_quantiles
from pagedserve.sim.simulator import build_deployment, simulate

SHAPE = ModelShape(num_layers=2, hidden_size=8, num_attention_heads=2, num_kv_heads=1, head_dim=4,
                   intermediate_size=16, vocab_size=10)


def cpu_truth(**kw) -> CostParams:
    base = dict(peak_flops=1e6, mem_bandwidth=1e6, gemm_mfu=0.5, gemm_mbu=0.0, attn_mfu=0.25, attn_mbu=0.5,
                step_overhead_s=0.004, per_request_overhead_s=0.0005, per_prefill_overhead_s=0.002,
                combine="sum", attention_pad_share=1.0)
    base.update(kw)
    return CostParams(**base)


def synthetic_steps(cm: CostModel, n: int = 400, seed: int = 0, swaps: bool = False, wall_per_cpu: float = 1.0,
                    per_output_s: float = 0.0, gap_s: float = 0.0) -> list[StepTrace]:
    """Steps of every kind with exact CPU times from `cm`, wall = wall_per_cpu x CPU + per_output x
    outputs, laid end to end with `gap_s` between them."""
    rng = random.Random(seed)
    out, t = [], 100.0
    for _ in range(n):
        kind = rng.random()
        batch = rng.randint(1, 12)
        new = [1] * batch
        if kind < 0.3:
            new[0] = rng.randint(2, 200)
        elif kind < 0.35:
            new = [rng.randint(2, 200) for _ in range(rng.randint(1, 3))]
        ctx = [k + rng.randint(0, 600) for k in new]
        outputs = sum(1 for k, c in zip(new, ctx) if k == 1 or rng.random() < 0.5)
        blocks = rng.choice([0, 0, 0, 4, 12]) if swaps else 0
        cpu = cm.predict(new, ctx, blocks, 0)
        wall = wall_per_cpu * cpu + per_output_s * outputs
        t += wall
        out.append(StepTrace(new, ctx, blocks, duration=wall, step_time=wall, t_end=t, cpu_time=cpu,
                             num_outputs=outputs, num_unfinished=5))
        t += gap_s
    return out


# -- the step fit ---------------------------------------------------------------------------
def test_fit_cpu_shape_then_wall_recovers_the_constants():
    m = ModelCost.from_shape(SHAPE, "float32", None, 1)
    truth = CostModel(m, cpu_truth())
    steps = synthetic_steps(truth, wall_per_cpu=3.0, per_output_s=0.002, gap_s=0.001)
    base = CostParams(peak_flops=1e6, mem_bandwidth=1e6, combine="sum")
    params, report = fit(steps, m, base, fit_pad_share=True, host_bandwidth_fallback=(1e9, "stated"))
    # The gap between steps is part of a step's cost to the server.
    assert report["step_gap"]["median_gap_s"] == pytest.approx(0.001, rel=1e-6)
    assert report["wall_per_cpu"] == pytest.approx(3.0, rel=0.03)
    # the gap between steps is per step, not per token: each term gets its own
    assert report["per_output_overhead_s"] == pytest.approx(0.002, rel=0.05)
    assert report["wall_per_step_s"] == pytest.approx(0.001, rel=0.15)
    assert report["attention_pad_share"] == 1.0
    fitted = CostModel(m, params)
    for r, wall in zip(steps[:60], step_costs(steps[:61])[0]):
        assert fitted.predict(r.new_tokens, r.context_lens, 0, r.num_outputs) == pytest.approx(wall, rel=0.05)
    assert abs(report["total_time_error"]) < 0.01
    assert report["shape_errors"]["all"]["mean_abs_rel_error"] < 0.01  # CPU times are exact here


def test_fit_picks_the_attention_padding_the_backend_pays():
    m = ModelCost.from_shape(SHAPE, "float32", None, 1)
    base = CostParams(peak_flops=1e6, mem_bandwidth=1e6, combine="sum")
    for share in (0.0, 1.0):
        truth = CostModel(m, cpu_truth(attention_pad_share=share, attn_mfu=0.02, attn_mbu=0.05))
        _, report = fit(synthetic_steps(truth, seed=3), m, base, fit_pad_share=True,
                        host_bandwidth_fallback=(1e9, "stated"))
        assert report["attention_pad_share"] == share


def test_calibrate_without_swaps_warns_and_never_fits_host_bandwidth_zero():
    m = ModelCost.from_shape(SHAPE, "float32", None, 1)
    base = CostParams(peak_flops=1e6, mem_bandwidth=1e6, combine="sum")
    steps = synthetic_steps(CostModel(m, cpu_truth()), swaps=False)
    params, report = fit(steps, m, base, host_bandwidth_fallback=(2e9, "a stated figure"))
    assert params.host_bandwidth == 2e9 and params.host_link_efficiency == 1.0
    assert any("no swaps in the trace" in w and "2.00 GB/s" in w for w in report["warnings"])
    # a swap now costs what the fallback says, not nothing
    swap = CostModel(m, params).breakdown(step_features(m, [1], [10], num_swap_blocks=4, block_size=16)).swap
    assert swap == pytest.approx(4 * 16 * m.kv_bytes_per_token / 2e9)
    # with no fallback and no stated bandwidth, one is measured here: still > 0, still warned about
    params, report = fit(steps, m, base)
    assert params.host_bandwidth > 0
    assert any("memcpy measured on this machine" in w for w in report["warnings"])


def test_calibrate_with_swaps_fits_the_host_bandwidth():
    m = ModelCost.from_shape(SHAPE, "float32", None, 1)
    truth = cpu_truth(host_bandwidth=5e3, host_link_efficiency=1.0)
    steps = synthetic_steps(CostModel(m, truth), swaps=True)
    params, report = fit(steps, m, CostParams(peak_flops=1e6, mem_bandwidth=1e6, combine="sum"))
    assert params.host_bandwidth * params.host_link_efficiency == pytest.approx(5e3, rel=0.02)
    assert not any("swap" in w for w in report["warnings"])
    assert report["coverage"]["swap_blocks"] == sum(r.num_swap_blocks for r in steps)


def test_calibrate_warns_where_the_trace_is_thin():
    m = ModelCost.from_shape(SHAPE, "float32", None, 1)
    cm = CostModel(m, cpu_truth())
    only_small_decodes = [StepTrace([1] * b, [20 + b] * b, duration=cm.predict([1] * b, [20 + b] * b),
                                    cpu_time=cm.predict([1] * b, [20 + b] * b)) for b in (1, 2, 3) * 10]
    _, report = fit(only_small_decodes, m, CostParams(peak_flops=1e6, mem_bandwidth=1e6, combine="sum"),
                    host_bandwidth_fallback=(1e9, "x"), max_model_len=1024)
    text = " | ".join(report["warnings"])
    for needle in ("only 30 steps", "no mixed steps", "no prefill steps", "decode batches only up to 3",
                   "no long contexts", "no swaps"):
        assert needle in text, needle
    assert run_beyond_coverage(report["coverage"], {"max_decode_batch": 16, "max_context": 23,
                                                    "max_step_tokens": 3, "max_prefill_chunk": 0,
                                                    "swap_blocks": 8}) == [
        "the run reached a decode batch of 16, the calibration trace 2 in 20 steps or more (at most 3): that part "
        "of the step cost is extrapolated",
        "the run swapped 8 blocks; the calibration trace had no swaps, so the swap cost is the fallback host "
        "bandwidth, not a fitted one"]


def test_a_decode_batch_seen_in_a_handful_of_steps_does_not_count_as_calibrated():
    """vLLM's CPU calibration (2026-12-05) had decode batches up to 7, but 13 of ~2,500 steps past 4: the fit
    carried the small batches' slope on and priced batches 5-16 at 1.15-1.65x what they took. A batch counts as
    covered where 20 steps reach it: the fit warns against max_num_seqs and a run beyond it is flagged."""
    m = ModelCost.from_shape(SHAPE, "float32", None, 1)
    cm = CostModel(m, cpu_truth())

    def steps(big: int) -> list[StepTrace]:
        shapes = [b for b in (1, 2, 3, 4) for _ in range(50)] + [12] * big
        return [StepTrace([1] * b, [40] * b, duration=cm.predict([1] * b, [40] * b),
                          cpu_time=cm.predict([1] * b, [40] * b)) for b in shapes]

    base = CostParams(peak_flops=1e6, mem_bandwidth=1e6, combine="sum")
    _, thin = fit(steps(10), m, base, host_bandwidth_fallback=(1e9, "x"), max_num_seqs=16)
    _, full = fit(steps(40), m, base, host_bandwidth_fallback=(1e9, "x"), max_num_seqs=16)
    assert (thin["coverage"]["max_decode_batch"], thin["coverage"]["decode_batch_reach"]) == (12, 4)
    assert (full["coverage"]["max_decode_batch"], full["coverage"]["decode_batch_reach"]) == (12, 12)
    assert any("decode batches reach 4 in 20 steps or more (at most 12), under half of max_num_seqs=16" in w
               for w in thin["warnings"])
    assert not any("decode batches" in w for w in full["warnings"])
    run = {"max_decode_batch": 12, "max_context": 40, "max_step_tokens": 12, "max_prefill_chunk": 0}
    assert run_beyond_coverage(thin["coverage"], run) == [
        "the run reached a decode batch of 12, the calibration trace 4 in 20 steps or more (at most 12): that part "
        "of the step cost is extrapolated"]
    assert run_beyond_coverage(full["coverage"], run) == []
    # a coverage stored before the reach was counted compares with its maximum, as it did
    old = {k: v for k, v in thin["coverage"].items() if k != "decode_batch_reach"}
    assert run_beyond_coverage(old, run) == []


def test_error_report_by_step_kind_by_hand():
    steps = [StepTrace([1, 1], [10, 20]), StepTrace([5, 1], [5, 30]), StepTrace([7], [7]), StepTrace([1], [600])]
    rep = error_report(steps, [1.1, 2.0, 2.0, 0.9], [1.0, 2.5, 2.0, 1.0])
    assert rep["by_kind"]["decode"]["num_steps"] == 2
    assert rep["by_kind"]["decode"]["bias"] == pytest.approx((0.1 - 0.1) / 2)
    assert rep["by_kind"]["decode"]["total_time_error"] == pytest.approx(2.0 / 2.0 - 1)
    assert rep["by_kind"]["mixed"]["bias"] == pytest.approx(-0.2)
    assert rep["by_kind"]["prefill"]["mean_abs_rel_error"] == 0.0
    assert set(rep["decode_by_context"]) == {"0-127", "512-2047"}
    assert rep["decode_by_batch"]["2-4"]["bias"] == pytest.approx(0.1)


# -- the serving overhead -------------------------------------------------------------------
def synthetic_serving(truth: ServingOverhead, n: int = 120, seed: int = 0, client_skew: float = 0.0):
    """Requests and steps whose admission and delivery follow `truth` exactly."""
    rng = random.Random(seed)
    steps, requests = [], []
    t = 1000.0
    for i in range(n):
        prompt = rng.randint(4, 900)
        t_http = t + rng.random()
        t_submit = t_http + client_skew + truth.admit(prompt) - client_skew
        first_n, last_n = rng.randint(1, 16), rng.randint(1, 16)
        t_first = t_submit + 0.05 + rng.random()
        t_last = t_first + 0.5 + rng.random()
        steps += [StepTrace([1] * first_n, [prompt] * first_n, t_end=t_first, num_outputs=first_n),
                  StepTrace([1] * last_n, [prompt + 9] * last_n, t_end=t_last, num_outputs=last_n)]
        requests.append({"request_id": f"r{i}", "prompt_len": prompt, "t_http": t_http, "t_submit": t_submit,
                         "t_first_token": t_first, "t_first_out": t_first + truth.deliver(first_n),
                         "t_last_token": t_last, "t_last_out": t_last + truth.deliver(last_n)})
        t = t_last + 2.0
    return requests, steps


def test_fit_serving_recovers_known_overhead_constants():
    truth = ServingOverhead(admit_s=0.012, admit_per_prompt_token_s=20e-6, deliver_s=0.004, deliver_per_output_s=0.0007)
    requests, steps = synthetic_serving(truth)
    fitted, report = fit_serving(requests, steps)
    assert fitted.admit_s == pytest.approx(0.012, rel=1e-6)
    assert fitted.admit_per_prompt_token_s == pytest.approx(20e-6, rel=1e-6)
    assert fitted.deliver_s == pytest.approx(0.004, rel=1e-6)
    assert fitted.deliver_per_output_s == pytest.approx(0.0007, rel=1e-6)
    assert report["num_deliveries"] == 2 * len(requests)
    assert abs(report["admission_residual_p99_s"]) < 1e-9
    with pytest.raises(ValueError, match="request_trace"):
        fit_serving(requests[:2], steps)


def test_admission_is_fitted_on_requests_that_found_the_server_free():
    """A burst queues at the HTTP loop and the tokenizer: those waits are the burst's, not the
    per-request cost; the fit uses the requests that arrived with nothing ahead of them."""
    truth = ServingOverhead(admit_s=0.010, deliver_s=0.003)
    requests, steps = synthetic_serving(truth, n=20)
    t = requests[-1]["t_last_out"] + 5.0
    for j in range(10):  # ten sent at once: the j-th waits for j others (20 ms each) first
        submit = t + 0.010 + 0.020 * j
        steps.append(StepTrace([1], [8], t_end=submit + 1.0, num_outputs=1))
        requests.append({"request_id": f"burst{j}", "prompt_len": 8, "t_http": t, "t_submit": submit,
                         "t_first_token": submit + 1.0, "t_first_out": submit + 1.003,
                         "t_last_token": None, "t_last_out": None})
    fitted, report = fit_serving(requests, steps)
    assert fitted.admit_s + fitted.admit_per_prompt_token_s * 8 == pytest.approx(0.010, abs=1e-3)
    assert report["num_admissions"] == 21 and report["admissions_from"].startswith("requests that found")


def test_client_records_add_what_the_server_cannot_see():
    truth = ServingOverhead(admit_s=0.010, deliver_s=0.003)
    requests, steps = synthetic_serving(truth, n=40)
    start = 900.0
    bench = {"run_start_monotonic": start, "requests": []}
    for q in requests:  # the client sent each 5 ms before the server saw it, got its tokens 2 ms after
        send = q["t_http"] - 0.005
        ttft = q["t_first_out"] + 0.002 - send
        bench["requests"].append({"success": True, "prompt_len": q["prompt_len"], "start": send - start,
                                  "ttft": ttft, "itl": [0.1, q["t_last_out"] + 0.002 - send - ttft - 0.1]})
    random.Random(1).shuffle(bench["requests"])
    assert match_client_records(requests, bench) == len(requests)
    fitted, report = fit_serving(requests, steps)
    assert fitted.admit_s == pytest.approx(0.015, abs=1e-9)
    assert fitted.deliver_s == pytest.approx(0.005, abs=1e-9)
    assert report["client_to_server_mean_s"] == pytest.approx(0.005)
    assert report["server_to_client_mean_s"] == pytest.approx(0.002)
    with pytest.raises(ValueError, match="run_start_monotonic"):
        match_client_records(requests, {"requests": []})


def test_simulator_adds_the_serving_overhead_to_ttft_and_e2e(tmp_path):
    from test_sim import cpu_params, write_config

    model_dir = write_config(tmp_path / "m")
    workload = [WorkloadRequest(None, None, 40, 5, arrival_time=10.0 * i) for i in range(4)]  # never overlap

    def run(serving: ServingOverhead):
        params = cpu_params()
        params.serving = serving.to_dict()
        dep = build_deployment(EngineConfig(num_kv_blocks=64, max_model_len=256), str(model_dir), cost_params=params)
        return simulate(dep, workload)

    plain = run(ServingOverhead())
    slowed = run(ServingOverhead(admit_s=0.1, admit_per_prompt_token_s=0.001, deliver_s=0.05,
                                 deliver_per_output_s=0.01))
    for a, b in zip(plain.records, slowed.records):
        assert b.arrival == a.arrival  # TTFT counts from the client's send, as the bench does
        # alone in the engine: admission 0.1 + 40 x 0.001, then each token one step-output later + 0.06
        assert b.ttft == pytest.approx(a.ttft + 0.14 + 0.06)
        assert b.e2el == pytest.approx(a.e2el + 0.14 + 0.06)
        assert b.itls() == pytest.approx(a.itls())
    assert slowed.to_dict()["serving_overhead"]["admit_s"] == 0.1


def test_delivery_jitter_is_fitted_from_the_clients_arrivals_of_every_token():
    """Each token reaches the client after the fitted delivery plus a scatter the step trace cannot
    see: the fit pairs every token with its step, keeps the residuals' quantiles (centred) and their
    lag-1 correlation, and leaves out streams whose tokens do not pair (a chunk of two tokens, a
    request missing from a step between its first and last token)."""
    rng = random.Random(5)
    deliver_s, per_output = 0.003, 0.0005
    steps, requests = [], []
    bench = {"run_start_monotonic": 0.0, "requests": []}
    t = 100.0
    for i in range(30):
        n = 20
        ends = [t + 0.004 * k for k in range(n)]
        steps += [StepTrace([1], [50 + k], t_end=e, num_outputs=1) for k, e in enumerate(ends)]
        # the scatter: +2 ms on three tokens in a row, then 0 on three
        extra = [0.002 if (k // 3) % 2 == 0 else 0.0 for k in range(n)]
        arrivals = [e + deliver_s + per_output + x for e, x in zip(ends, extra)]
        req = {"request_id": f"r{i}", "prompt_len": 50 + i, "t_http": t - 0.01, "t_submit": t - 0.009,
               "t_first_token": ends[0], "t_first_out": ends[0] + deliver_s, "t_last_token": ends[-1],
               "t_last_out": ends[-1] + deliver_s, "num_tokens": n}
        chunks = n - 1 if i == 0 else n  # stream 0: two tokens came in one chunk
        requests.append(req)
        bench["requests"].append({"success": True, "prompt_len": 50 + i, "start": t - 0.011,
                                  "ttft": arrivals[0] - (t - 0.011), "output_tokens": n,
                                  "itl": [b - a for a, b in zip(arrivals, arrivals[1:])][:chunks - 1]})
        t = ends[-1] + 1.0 + rng.random()
    # stream 1 was preempted: a step in its span left it out (one step more than its tokens)
    requests[1]["t_last_token"] = steps[2 * 20 - 1].t_end
    requests[1]["num_tokens"] = 19
    assert match_client_records(requests, bench) == 30
    fitted, report = fit_serving(requests, steps)
    jitter = report["delivery_jitter"]
    assert jitter["num_streams"] == 28 and jitter["num_tokens"] == 28 * 20
    q = fitted.delivery_jitter_s
    assert len(q) == SCATTER_QUANTILES and q == sorted(q) and abs(sum(q) / len(q)) < 1e-4
    # two residual values, 2 ms apart, 11 of a stream's 20 the high one
    assert q[-1] - q[0] == pytest.approx(0.002, abs=1e-4)
    assert q[400] == pytest.approx(q[0], abs=1e-4) and q[600] == pytest.approx(q[-1], abs=1e-4)
    assert 0.2 < fitted.delivery_jitter_rho < 0.5  # runs of three alike: correlated at lag 1 (1/3 for endless runs)
    assert "scatters" in fitted.describe()
    # a calibration without the client's per-chunk times fits none
    for q_ in requests:
        q_.pop("t_client_itl")
    assert fit_serving(requests, steps)[0].delivery_jitter_s == []


def test_simulator_scatters_each_tokens_arrival_by_the_fitted_jitter(tmp_path):
    from test_sim import cpu_params, write_config

    model_dir = write_config(tmp_path / "m")
    workload = [WorkloadRequest(None, None, 40, 60, arrival_time=0.5 * i) for i in range(6)]

    def run(quantiles, rho=0.0, seed=0):
        params = cpu_params()
        params.serving = ServingOverhead(deliver_s=0.004, delivery_jitter_s=quantiles,
                                         delivery_jitter_rho=rho).to_dict()
        dep = build_deployment(EngineConfig(num_kv_blocks=256, max_model_len=256), str(model_dir), cost_params=params)
        return simulate(dep, workload, seed=seed)

    spread = [-0.001] * 50 + [0.001] * 50  # +-1 ms, half and half
    plain, scattered = run([]), run(spread)
    again, other_seed = run(spread), run(spread, seed=1)
    for a, b in zip(plain.records, scattered.records):
        # every token 1 ms either side of where it was, in order, and never before its step ended
        diffs = [y - x for x, y in zip(a.token_times, b.token_times)]
        assert all(abs(abs(d) - 0.001) < 1e-9 or d >= -0.001 for d in diffs)
        assert b.token_times == sorted(b.token_times)
        assert min(diffs) < 0 < max(diffs)
    itl_plain = sorted(x for r in plain.records for x in r.itls())
    itl_scat = sorted(x for r in scattered.records for x in r.itls())
    assert sum(itl_scat) / len(itl_scat) == pytest.approx(sum(itl_plain) / len(itl_plain), rel=0.01)
    assert itl_scat[int(0.99 * len(itl_scat))] > itl_plain[int(0.99 * len(itl_plain))] + 0.0015
    assert [r.token_times for r in again.records] == [r.token_times for r in scattered.records]  # seeded
    assert [r.token_times for r in other_seed.records] != [r.token_times for r in scattered.records]
    # correlated draws move together: fewer 2 ms jumps between neighbours than independent ones
    corr = run(spread, rho=0.9)

    def jumps(res):
        return sum(1 for r in res.records for x, y in zip(r.itls(), r.itls()[1:]) if abs(y - x) > 0.003)

    assert jumps(corr) < jumps(scattered) / 2


def test_a_drawn_scatter_keeps_the_measured_tail():
    """The step residuals and the delivery jitter are stored as quantiles and drawn by inverse transform:
    the draws' P99 is the measured P99, and a rare stall stays as rare. (Stored as 100 values with one
    picked at random, 0.6% of steps stalling 50 ms became 1% of draws, and the draws' P99 was the stall.)"""
    rng = random.Random(5)
    measured = [rng.uniform(-0.001, 0.001) for _ in range(2994)] + [0.05] * 18  # 0.6% stalls
    q = scatter_quantiles(measured)
    assert len(q) == SCATTER_QUANTILES and q == sorted(q)
    draw = random.Random(11)
    draws = sorted(quantile_at(q, draw.random()) for _ in range(200_000))
    p99 = draws[int(0.99 * len(draws))]
    assert p99 < 0.0011  # the measured P99 is in the +-1 ms body
    stalled = sum(1 for d in draws if d > 0.025) / len(draws)
    assert 0.004 < stalled < 0.008
    # interpolation between the stored values, held at the ends
    assert quantile_at([0.0, 1.0], 0.5) == pytest.approx(0.5) and quantile_at([0.0, 1.0], 0.1) == 0.0
    assert quantile_at([0.0, 1.0], 0.99) == 1.0 and quantile_at([0.0, 1.0, 3.0], 0.5) == 1.0


def test_a_burst_enters_the_engine_in_the_order_it_was_sent(tmp_path):
    """A fitted admission grows with the prompt, but one loop and one tokenizer thread take requests
    in turn: a burst of long and short prompts reaches the engine first come, not shortest first
    (the engine serves its queue first come, first served, so the order sets every TTFT)."""
    from test_sim import cpu_params, write_config

    model_dir = write_config(tmp_path / "m")
    lengths = [200, 20, 150, 40, 180, 10]
    workload = [WorkloadRequest(None, None, n, 8, arrival_time=0.0) for n in lengths]
    params = cpu_params()
    params.serving = ServingOverhead(admit_s=0.002, admit_per_prompt_token_s=1e-5, deliver_s=0.001).to_dict()
    dep = build_deployment(EngineConfig(num_kv_blocks=64, max_model_len=256, max_num_seqs=1), str(model_dir),
                           cost_params=params)
    res = simulate(dep, workload)
    by_ttft = sorted(res.records, key=lambda r: r.ttft)
    assert [r.prompt_len for r in by_ttft] == lengths  # one at a time, in the order sent


# -- the calibration workload -----------------------------------------------------------------
def test_calibration_workload_spans_shapes_and_ramps_the_rate():
    w = make_workload("calibration", 400, request_rate=2.0, input_len=200, output_len=50, vocab_size=1000,
                      max_len=300)
    prompts, outputs = [r.prompt_len for r in w], [r.output_len for r in w]
    assert min(prompts) <= 12 and max(prompts) >= 250
    assert min(outputs) <= 6 and max(outputs) >= 60
    assert all(p + o <= 300 for p, o in zip(prompts, outputs))
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in w)
    gaps = [b.arrival_time - a.arrival_time for a, b in zip(w, w[1:])]
    first, last = sum(gaps[:100]) / 100, sum(gaps[-100:]) / 100
    assert first > 3 * last  # from 0.1x to 2x the rate: gaps shrink
    assert ramp_arrival_times(3, 1.0, seed=1) == ramp_arrival_times(3, 1.0, seed=1)
    with pytest.raises(ValueError, match="request_rate"):
        make_workload("calibration", 10, request_rate=math.inf)


# -- the live trace and the simulated trace ------------------------------------------------------
def test_server_writes_a_request_trace_matched_to_its_steps(tmp_path, tiny_llama):
    import httpx

    from pagedserve.server.launcher import ServerThread, build_server

    steps_path = tmp_path / "steps.jsonl"
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=128, step_trace_path=str(steps_path))
    app, _ = build_server(config)
    with ServerThread(app) as st:
        for prompt, n in (([5, 6, 7, 8], 6), ([9, 10], 3)):
            with httpx.stream("POST", st.url + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200
                # a chunk per step, or fewer: outputs that queued while the consumer was behind go as one
                assert sum(1 for line in r.iter_lines() if line.startswith("data: {")) >= 1
        # not traced: a response without per-token timing
        assert httpx.post(st.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}).status_code == 200
    steps = [StepTrace.from_dict(json.loads(line)) for line in steps_path.read_text().splitlines()]
    lines = [json.loads(line) for line in (tmp_path / "steps.requests.jsonl").read_text().splitlines()]
    assert [(q["prompt_len"], q["num_tokens"]) for q in lines] == [(4, 6), (2, 3)]
    assert all(1 <= q["num_chunks"] <= q["num_tokens"] for q in lines)
    by_end = {s.t_end: s for s in steps}
    for q in lines:
        assert q["t_http"] <= q["t_submit"] <= q["t_scheduled"] <= q["t_first_token"] <= q["t_first_out"]
        assert q["t_first_out"] <= q["t_last_out"] and q["t_last_token"] <= q["t_last_out"]
        assert by_end[q["t_first_token"]].num_outputs >= 1  # the very step, by its end time
        assert by_end[q["t_last_token"]].num_outputs >= 1
    assert all(s.cpu_time > 0 and s.t_end > 0 for s in steps)
    assert steps[-1].num_unfinished == 0


def test_simulate_writes_the_step_trace_it_is_asked_for(tmp_path, capsys):
    from pagedserve.cli import main
    from test_sim import cpu_params, write_config

    model_dir = write_config(tmp_path / "m")
    cost = tmp_path / "cost.json"
    params = cpu_params()
    params.serving = ServingOverhead(admit_s=0.01, deliver_s=0.002, source="test").to_dict()
    cost.write_text(json.dumps({"params": params.to_dict()}))
    trace, result = tmp_path / "sim_steps.jsonl", tmp_path / "r.json"
    assert main(["simulate", "--device", "cpu", "--model", str(model_dir), "--cost-model", str(cost),
                 "--num-kv-blocks", "64", "--max-model-len", "256", "--num-prompts", "12", "--random-input-len", "40",
                 "--random-output-len", "6", "--request-rate", "20", "--step-trace-path", str(trace),
                 "--result-json", str(result)]) == 0
    printed = capsys.readouterr().out
    assert "serving overhead: admission 10.0 ms" in printed and "delivery 2.0 ms" in printed
    steps = [StepTrace.from_dict(json.loads(line)) for line in trace.read_text().splitlines()]
    data = json.loads(result.read_text())
    assert len(steps) == data["num_steps"] > 0
    from pagedserve.plan.models import load_model
    cm = CostModel(ModelCost.from_shape(load_model(str(model_dir)).shape, "float32", "float32", 1), params)
    t = 0.0
    for s in steps:  # virtual time: each step lasts what the cost model says, on the virtual clock
        assert s.step_time == pytest.approx(cm.predict(s.new_tokens, s.context_lens, s.num_swap_blocks, s.num_outputs))
        assert s.cpu_time == pytest.approx(s.step_time)
        assert s.t_end >= t + s.step_time - 1e-9
        t = s.t_end
    assert steps[-1].t_end <= data["duration"]


# -- servers without a step trace (vLLM): steps rebuilt from the client's token arrivals --------
def test_steps_rebuilt_from_token_arrivals_by_hand():
    from pagedserve.sim.reconstruct import histogram_mean, serving_from_metrics, steps_from_bench

    # Engine steps (end times): A alone (prefill, 2 decodes), then B joins; an idle spell; C alone.
    # step 1 @1.00: A prefill (prompt 10)      step 2 @1.05: A decode
    # step 3 @1.10: A decode, B prefill (20)   step 4 @1.15: A decode, B decode
    # idle ... step 5 @3.00: C prefill (5)     step 6 @3.04: C decode
    arrivals = {"A": [1.00, 1.05, 1.10, 1.15], "B": [1.1003, 1.1502], "C": [3.00, 3.04]}
    prompts, sends = {"A": 10, "B": 20, "C": 5}, {"A": 0.9, "B": 1.02, "C": 2.95}
    result = {"requests": [{"success": True, "prompt_len": prompts[k], "start": sends[k], "num_chunks": len(t),
                            "output_tokens": len(t), "ttft": t[0] - sends[k],
                            "itl": [b - a for a, b in zip(t, t[1:])]} for k, t in arrivals.items()]
              + [{"success": False, "prompt_len": 3, "start": 0.0, "num_chunks": 0}]}
    rebuilt = steps_from_bench(result, threshold_s=0.01)
    assert rebuilt.num_clusters == 6 and rebuilt.num_idle_starts == 2 and rebuilt.num_skipped == 1
    got = [(s.new_tokens, s.context_lens, round(s.step_time, 6)) for s in rebuilt.steps]
    assert got == [([1], [11], 0.05),                  # A's 2nd token: decode at context 10 + 1
                   ([1, 20], [12, 20], 0.05),          # A decodes while B's prompt runs
                   ([1, 1], [13, 21], 0.05),
                   ([1], [6], 0.04)]                   # after C's idle start (left out)
    # Metrics: the client's TTFT minus the engine's queue + prefill is the serving overhead.
    before = ("vllm:request_queue_time_seconds_sum{model_name=\"m\"} 1.0\n"
              "vllm:request_queue_time_seconds_count{model_name=\"m\"} 10\n"
              "vllm:request_prefill_time_seconds_sum{model_name=\"m\"} 2.0\n"
              "vllm:request_prefill_time_seconds_count{model_name=\"m\"} 10\n")
    after = ("vllm:request_queue_time_seconds_sum{model_name=\"m\"} 1.03\n"
             "vllm:request_queue_time_seconds_count{model_name=\"m\"} 13\n"
             "vllm:request_prefill_time_seconds_sum{model_name=\"m\"} 2.06\n"
             "vllm:request_prefill_time_seconds_count{model_name=\"m\"} 13\n")
    assert histogram_mean(before, after, "vllm:request_queue_time_seconds") == (pytest.approx(0.01), 3)
    overhead, report = serving_from_metrics(result, before, after)
    client = ((1.00 - 0.9) + (1.1003 - 1.02) + (3.00 - 2.95)) / 3
    assert overhead == pytest.approx(client - 0.01 - 0.02)
    assert report["client_ttft_mean_s"] == pytest.approx(client)


def test_calibration_runs_are_rebuilt_and_pooled_together():
    """`simulate calibrate --from-bench A B`: the runs follow one another with an idle spell between
    (no step is timed across it), and the engine's queue and prefill means pool every run's counts."""
    from pagedserve.sim.reconstruct import merge_runs, serving_from_metrics, steps_from_bench

    def run(arrivals, sends):
        return {"requests": [{"success": True, "prompt_len": 10, "start": sends[k], "num_chunks": len(t),
                              "output_tokens": len(t), "ttft": t[0] - sends[k],
                              "itl": [b - a for a, b in zip(t, t[1:])]} for k, t in arrivals.items()]}

    fast = run({"A": [1.00, 1.04, 1.08, 1.12], "B": [1.0402, 1.0801]}, {"A": 0.95, "B": 1.01})
    slow = run({"A": [1.00, 1.06, 1.12, 1.18], "B": [1.0602, 1.1201]}, {"A": 0.95, "B": 1.01})  # same clock
    merged = merge_runs([fast, slow])
    assert len(merged["requests"]) == 4
    assert min(r["start"] for r in merged["requests"][2:]) >= 1.12 + 10.0 - 1e-9  # after the first's last token
    rebuilt = steps_from_bench(merged, threshold_s=0.01)
    assert rebuilt.num_idle_starts == 2
    assert sorted(round(s.step_time, 6) for s in rebuilt.steps) == [0.04] * 3 + [0.06] * 3
    assert steps_from_bench(merge_runs([fast]), threshold_s=0.01).steps[0].step_time == pytest.approx(0.04)

    def scrape(queue_sum, queue_n, prefill_sum, prefill_n):
        return (f"vllm:request_queue_time_seconds_sum {queue_sum}\nvllm:request_queue_time_seconds_count {queue_n}\n"
                f"vllm:request_prefill_time_seconds_sum {prefill_sum}\n"
                f"vllm:request_prefill_time_seconds_count {prefill_n}\n")

    # run 1: 2 requests, queue 0.01 each, prefill 0.02 each; run 2: 6 requests, queue 0.03, prefill 0.04
    befores = [scrape(0, 0, 0, 0), scrape(0.02, 2, 0.04, 2)]
    afters = [scrape(0.02, 2, 0.04, 2), scrape(0.2, 8, 0.28, 8)]
    _, report = serving_from_metrics(merged, befores, afters)
    assert report["engine_queue_mean_s"] == pytest.approx((0.02 + 0.18) / 8)
    assert report["engine_prefill_mean_s"] == pytest.approx((0.04 + 0.24) / 8)
    with pytest.raises(ValueError, match="scrapes"):
        serving_from_metrics(merged, befores, afters[:1])


def test_a_step_is_timed_only_while_a_running_request_kept_the_engine_busy():
    from pagedserve.sim.reconstruct import steps_from_bench

    # A's last token at 1.10; B was sent at 1.08, before it, but its prompt reached the engine only
    # after the API server's work: its first token at 1.40 is no 300 ms step, the engine idled.
    arrivals = {"A": [1.00, 1.05, 1.10], "B": [1.40, 1.45]}
    sends = {"A": 0.9, "B": 1.08}
    result = {"requests": [{"success": True, "prompt_len": 16, "start": sends[k], "num_chunks": len(t),
                            "output_tokens": len(t), "ttft": t[0] - sends[k],
                            "itl": [b - a for a, b in zip(t, t[1:])]} for k, t in arrivals.items()]}
    rebuilt = steps_from_bench(result, threshold_s=0.01)
    assert [(s.new_tokens, round(s.step_time, 6)) for s in rebuilt.steps] == [([1], 0.05), ([1], 0.05), ([1], 0.05)]
    assert rebuilt.num_idle_starts == 2


def test_one_stray_step_of_a_rare_kind_does_not_set_the_prompt_terms():
    # A trace rebuilt from a client's token arrivals (vLLM's CPU server) held 2,280 decode steps, 71
    # mixed and one lone prefill whose duration held an idle wait: weighed as a third of the fit,
    # that one step priced every mixed step ~20% high (its 41% excess was inside the trim, the
    # decode steps scattering 13%). Here the trim is off, so the stray step stays in the fit.
    m = ModelCost.from_shape(SHAPE, "float32", None, 1)
    truth = CostModel(m, cpu_truth(attention_pad_share=0.0))
    rng = random.Random(5)
    steps, true_mixed = [], []
    for k in range(400):
        new = [1] * rng.randint(1, 6)
        if k % 5 == 0:
            new = [rng.randint(20, 200)] + new  # a prompt finishing among decodes
        ctx = [n + rng.randint(0, 300) for n in new]
        wall = truth.predict(new, ctx) * rng.uniform(0.9, 1.1)
        steps.append(StepTrace(new, ctx, duration=wall, step_time=wall, num_outputs=len(new)))
    stray = truth.predict([150], [150]) * 3.0
    steps.append(StepTrace([150], [150], duration=stray, step_time=stray, num_outputs=1))
    params, report = fit(steps, m, CostParams(peak_flops=1e6, mem_bandwidth=1e6, combine="sum"),
                         host_bandwidth_fallback=(1e9, "stated"), trim=100.0)
    assert report["num_used"] == len(steps)
    fitted = CostModel(m, params)
    mixed = [r for r in steps if len(r.new_tokens) > 1 and max(r.new_tokens) > 1]
    ratio = (sum(fitted.predict(r.new_tokens, r.context_lens) for r in mixed)
             / sum(truth.predict(r.new_tokens, r.context_lens) for r in mixed))
    assert ratio == pytest.approx(1.0, abs=0.02)


VLLM_LIKE_CONFIG = dict(num_kv_blocks=256, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512)


def vllm_like_run(model_dir, params, admit_s: float, seed: int = 3):
    """A run made by the simulator with a known admission, as vLLM's client and /metrics would show it:
    (the bench result, the scrape before, the scrape after). vLLM's queue time starts when its engine
    loop takes the request in, after the step running at the arrival, so that wait is in neither its
    queue nor its prefill time."""
    from dataclasses import replace

    def build(p):
        return build_deployment(EngineConfig(**VLLM_LIKE_CONFIG), str(model_dir), cost_params=p)

    rng = random.Random(seed)
    t, workload = 0.0, []
    for _ in range(60):
        t += rng.expovariate(4.0)
        workload.append(WorkloadRequest(None, None, rng.randint(20, 200), rng.randint(4, 40), arrival_time=t))
    steps, firsts = [], {}

    def on_step(outs):
        steps.append((outs.timestamp - outs.execute_time, outs.timestamp))
        for o in outs.outputs:
            if o.first_scheduled_time is not None:
                firsts[o.request_id] = (o.arrival_time, o.first_scheduled_time, outs.timestamp)

    sim = simulate(build(replace(params, serving=ServingOverhead(admit_s=admit_s).to_dict())), workload,
                   on_step=on_step)

    def queued_at(entry):
        return next((end for start, end in steps if start < entry < end), entry)

    queue = [s - queued_at(e) for e, s, _ in firsts.values()]
    prefill = [f - s for _, s, f in firsts.values()]
    result = {"requests": [{"success": True, "prompt_len": r.prompt_len, "output_tokens": len(r.token_times),
                            "num_chunks": len(r.token_times), "start": r.arrival, "ttft": r.ttft,
                            "itl": [b - a for a, b in zip(r.token_times, r.token_times[1:])]} for r in sim.records]}
    before = "".join(f"vllm:request_{n}_time_seconds_{k} 0\n" for n in ("queue", "prefill") for k in ("sum", "count"))
    after = "".join(f"vllm:request_{n}_time_seconds_sum {sum(v)}\nvllm:request_{n}_time_seconds_count {len(v)}\n"
                    for n, v in (("queue", queue), ("prefill", prefill)))
    return result, before, after, build


def vllm_like_params(step_overhead_s: float = 8e-3) -> CostParams:
    return CostParams(peak_flops=1e12, mem_bandwidth=1e11, gemm_mfu=1e-3, gemm_mbu=0.0, attn_mfu=0.0,
                      attn_mbu=0.0, step_overhead_s=step_overhead_s, combine="sum")


def test_admission_by_replay_recovers_a_known_admission_the_subtraction_overstates(tmp_path):
    from test_sim import write_config

    from pagedserve.sim.reconstruct import serving_from_metrics
    from pagedserve.sim.replay_fit import serving_by_replay

    params = vllm_like_params()
    result, before, after, build = vllm_like_run(write_config(tmp_path / "m"), params, admit_s=0.006)
    subtracted, measured = serving_from_metrics(result, before, after)
    assert subtracted > 1.3 * 0.006, subtracted  # the wait for the running step, counted in the admission
    serving, report = serving_by_replay(result, params, build, measured["engine_queue_mean_s"],
                                        measured["engine_prefill_mean_s"])
    assert serving.admit_s == pytest.approx(0.006, rel=0.03)
    assert report["replay_ttft_mean_s"] == pytest.approx(report["client_ttft_mean_s"], rel=0.01)
    assert report["replay_prefill_mean_s"] == pytest.approx(measured["engine_prefill_mean_s"], rel=1e-6)
    assert report["warnings"] == []


def test_cli_calibrates_from_several_client_runs_at_once(tmp_path, capsys):
    """Calibration runs of a server that writes no step trace, fitted together: two at the same speed give
    back the admission from both replayed in turn; with one on a machine 1.2x slower the step costs land
    between the two, and the replay matches the client's mean TTFT over both."""
    from pagedserve.cli import main
    from test_sim import write_config

    model_dir = write_config(tmp_path / "m")
    files = {}
    ttfts = {}
    for name, overhead, seed in (("fast", 8e-3, 3), ("fast2", 8e-3, 5), ("slow", 9.6e-3, 4)):
        result, before, after, _ = vllm_like_run(model_dir, vllm_like_params(overhead), admit_s=0.006, seed=seed)
        for kind, text in (("bench.json", json.dumps(result)), ("before.txt", before), ("after.txt", after)):
            files[name, kind] = tmp_path / f"{name}.{kind}"
            files[name, kind].write_text(text)
        ttfts[name] = [r["ttft"] for r in result["requests"]]

    def calibrate(runs, out, afters=None):
        knobs = [str(VLLM_LIKE_CONFIG[k]) for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens")]
        return main(["simulate", "calibrate", "--model", str(model_dir), "--no-step-spread",
                     "--max-model-len", knobs[0], "--max-num-seqs", knobs[1], "--max-num-batched-tokens", knobs[2],
                     "--from-bench", *[str(files[r, "bench.json"]) for r in runs],
                     "--metrics-before", *[str(files[r, "before.txt"]) for r in runs],
                     "--metrics-after", *[str(files[r, "after.txt"]) for r in (afters or runs)],
                     "--out", str(out)])

    per_step = {}
    for runs in (["fast"], ["slow"], ["fast", "slow"], ["fast", "fast2"]):
        out = tmp_path / f"{'+'.join(runs)}.json"
        assert calibrate(runs, out) == 0
        saved = json.loads(out.read_text())
        model = CostModel(ModelCost.from_shape(SHAPE, "float32", None, 1), CostParams.from_dict(saved["params"]))
        per_step["+".join(runs)] = model.predict([1] * 12, [100] * 12)  # past the fitted small-count factors
        replayed = saved["serving_fit"]["replay"]
        client = [t for r in runs for t in ttfts[r]]
        assert replayed["num_requests"] == len(client)
        assert replayed["client_ttft_mean_s"] == pytest.approx(sum(client) / len(client))
        assert replayed["replay_ttft_mean_s"] == pytest.approx(replayed["client_ttft_mean_s"], rel=0.01)
        if runs == ["fast", "fast2"]:
            assert ServingOverhead.from_dict(saved["params"]["serving"]).admit_s == pytest.approx(0.006, rel=0.1)
    assert per_step["fast"] * 1.15 < per_step["slow"]
    assert per_step["fast"] * 1.05 < per_step["fast+slow"] < per_step["slow"] / 1.05
    capsys.readouterr()
    with pytest.raises(SystemExit, match="one file per --from-bench run"):
        calibrate(["fast", "slow"], tmp_path / "x.json", afters=["fast"])


def test_a_run_whose_output_came_in_bursts_is_left_out_of_the_calibration(tmp_path, capsys):
    """vLLM's CPU server sometimes stalls and then writes several steps' tokens back to back (2026-12-05: 52% of
    one calibration run's arrival clusters cut, its mean TTFT 93 ms against ~40). Such a run rebuilds as long
    steps followed by empty ones: it is left out of the step fit and of the admission's replay, and said so."""
    from pagedserve.cli import main
    from pagedserve.sim.reconstruct import steps_from_bench
    from test_sim import write_config

    model_dir = write_config(tmp_path / "m")
    clean, before, after, _ = vllm_like_run(model_dir, vllm_like_params(8e-3), admit_s=0.006, seed=3)
    slow, sbefore, safter, _ = vllm_like_run(model_dir, vllm_like_params(9.6e-3), admit_s=0.012, seed=4)
    for r in slow["requests"]:  # every 4 tokens reach the client together, at the last one's time
        times = [r["start"] + r["ttft"]]
        for gap in r["itl"]:
            times.append(times[-1] + gap)
        burst = [times[min(len(times) - 1, 4 * (k // 4) + 3)] + 1e-6 * (k % 4) for k in range(len(times))]
        r["ttft"], r["itl"] = burst[0] - r["start"], [b - a for a, b in zip(burst, burst[1:])]
    assert not steps_from_bench(clean).bursty and steps_from_bench(slow).bursty
    files = {}
    for name, (res, b, a) in {"clean": (clean, before, after), "bursty": (slow, sbefore, safter)}.items():
        for kind, text in (("bench.json", json.dumps(res)), ("before.txt", b), ("after.txt", a)):
            files[name, kind] = tmp_path / f"{name}.{kind}"
            files[name, kind].write_text(text)

    def calibrate(runs, out):
        return main(["simulate", "calibrate", "--model", str(model_dir), "--no-step-spread",
                     "--max-model-len", "512", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
                     "--from-bench", *[str(files[r, "bench.json"]) for r in runs],
                     "--metrics-before", *[str(files[r, "before.txt"]) for r in runs],
                     "--metrics-after", *[str(files[r, "after.txt"]) for r in runs], "--out", str(out)])

    assert calibrate(["clean"], tmp_path / "alone.json") == 0
    assert calibrate(["clean", "bursty"], tmp_path / "both.json") == 0
    alone, both = (json.loads((tmp_path / f).read_text()) for f in ("alone.json", "both.json"))
    measured_here = {"host_bandwidth"}  # a memcpy timed on each call
    assert ({k: v for k, v in both["params"].items() if k not in measured_here}
            == {k: v for k, v in alone["params"].items() if k not in measured_here})
    assert both["fit"]["runs_left_out"] == [str(files["bursty", "bench.json"])]
    assert any(w.startswith(f"left out {files['bursty', 'bench.json']}") and "in bursts" in w
               for w in both["fit"]["warnings"])
    capsys.readouterr()
    with pytest.raises(SystemExit, match="every run was left out"):
        calibrate(["bursty"], tmp_path / "none.json")


def test_replay_warns_when_its_prefill_is_off_the_engines_or_no_admission_fits():
    from pagedserve.sim.replay_fit import replay_warnings

    ok = {"engine_prefill_mean_s": 0.054, "replay_prefill_mean_s": 0.0557, "admit_s": 0.006,
          "replay_ttft_mean_s": 0.0697, "client_ttft_mean_s": 0.0697}
    assert replay_warnings(ok) == []
    high = {**ok, "replay_prefill_mean_s": 0.066}  # the 22:52 fit before the stray step was fixed
    assert len(replay_warnings(high)) == 1 and "+22%" in replay_warnings(high)[0]
    over = {**ok, "admit_s": 0.0, "replay_ttft_mean_s": 0.0971, "client_ttft_mean_s": 0.0942}
    assert len(replay_warnings(over)) == 1 and "no admission" in replay_warnings(over)[0]


def test_step_scatter_is_fitted_and_added_to_every_simulated_step(tmp_path):
    from test_sim import cpu_params, write_config

    # The fit reports how far steps land from the model: here one in ten stalls 3 ms.
    m = ModelCost.from_shape(SHAPE, "float32", None, 1)
    truth = CostModel(m, cpu_truth(attention_pad_share=0.0))
    rng = random.Random(7)
    steps = []
    for k in range(300):
        new = [1] * rng.randint(1, 6) + ([rng.randint(20, 200)] if k % 4 == 0 else [])
        ctx = [n + rng.randint(0, 300) for n in new]
        wall = truth.predict(new, ctx) + (0.003 if k % 10 == 3 else 0.0)
        steps.append(StepTrace(new, ctx, duration=wall, step_time=wall, num_outputs=len(new)))
    _, report = fit(steps, m, CostParams(peak_flops=1e6, mem_bandwidth=1e6, combine="sum"),
                    host_bandwidth_fallback=(1e9, "stated"))
    q = report["step_residual_quantiles_s"]
    assert len(q) == SCATTER_QUANTILES and q == sorted(q)
    # (the fit takes a little of the stalls into its constants: the rest miss by a few tenths of a ms)
    assert abs(q[500]) < 5e-4 and q[950] - q[500] == pytest.approx(0.003, abs=5e-4) and q[50] - q[500] > -1e-3

    # The simulator adds a draw to every step: a lone request's every token comes 2 ms a step later.
    model_dir = write_config(tmp_path / "m")
    workload = [WorkloadRequest(None, None, 40, 5, arrival_time=0.0)]

    def run(residuals):
        params = cpu_params()
        params.step_residuals_s = residuals
        return simulate(build_deployment(EngineConfig(num_kv_blocks=64, max_model_len=256), str(model_dir),
                                         cost_params=params), workload).records[0]

    plain, scattered = run([]), run([0.002] * 100)
    assert [b - a for a, b in zip(plain.token_times, scattered.token_times)] == pytest.approx(
        [0.002 * (k + 1) for k in range(5)])


def test_warm_up_after_idle_is_fitted_and_replayed(tmp_path):
    """On a CPU the first decode steps after an idle spell run slower than the same steps back to back:
    the fit measures a factor per position after idle from the trace (leaving those steps out of the shape
    fit), and the simulator applies it to the steps after its own idle spells, not to others."""
    from pagedserve.sim.calibration import steps_after_idle
    from test_sim import cpu_params, write_config

    m = ModelCost.from_shape(SHAPE, "float32", None, 1)
    truth = CostModel(m, cpu_truth(attention_pad_share=0.0))
    slow = [1.4, 1.25, 1.1]

    def trace(factors):
        rng = random.Random(3)
        steps, t = [], 100.0
        for burst in range(40):
            t += 0.5  # idle
            new = [rng.randint(20, 200)]
            for k in range(16):
                ctx = [n + rng.randint(0, 300) for n in new]
                cost = truth.predict(new, ctx) * (factors[k - 1] if 1 <= k <= len(factors) else 1.0)
                t += cost
                steps.append(StepTrace(new, ctx, duration=cost, step_time=cost, t_end=t, cpu_time=cost,
                                       num_outputs=len(new), num_unfinished=1 if k < 15 else 0))
                t += 0.0002  # the engine's own gap between steps: not idle
                new = [1] * rng.randint(1, 4) + ([rng.randint(20, 200)] if k % 5 == 4 else [])
        return steps

    steps = trace(slow)
    assert steps_after_idle(steps)[:18] == list(range(16)) + [0, 1]
    base = CostParams(peak_flops=1e6, mem_bandwidth=1e6, combine="sum")
    params, report = fit(steps, m, base, host_bandwidth_fallback=(1e9, "stated"))
    assert params.warmup_factors == pytest.approx(slow, rel=0.01)
    assert report["warmup_steps_seen"] == [40, 40, 40, 40]
    # the shape was fitted on the warm steps: a warm step is priced as the truth prices it
    assert report["errors"]["all"]["mean_abs_rel_error"] < 0.02
    # no slowdown in the trace, no factor
    assert fit(trace([]), m, base, host_bandwidth_fallback=(1e9, "stated"))[0].warmup_factors == []

    # The simulator: a lone request arriving to an idle engine has its 2nd and 3rd steps slowed; a second
    # request arriving 1 ms after the first finishes (under warmup_idle_s) starts warm.
    model_dir = write_config(tmp_path / "m")

    def gaps(factors, second_at):
        params = cpu_params()
        params.warmup_factors = factors
        workload = [WorkloadRequest(None, None, 40, 6, arrival_time=0.0),
                    WorkloadRequest(None, None, 40, 6, arrival_time=second_at)]
        res = simulate(build_deployment(EngineConfig(num_kv_blocks=64, max_model_len=256), str(model_dir),
                                        cost_params=params), workload)
        return [[b - a for a, b in zip(r.token_times, r.token_times[1:])] for r in res.records]

    plain = gaps([], 10.0)
    assert plain[0] == pytest.approx(plain[1])
    warm = gaps([2.0, 1.5], 10.0)  # both requests find the engine idle
    for p, w in zip(plain, warm):
        assert w[:2] == pytest.approx([2.0 * p[0], 1.5 * p[1]]) and w[2:] == pytest.approx(p[2:])
    first_end = simulate(build_deployment(EngineConfig(num_kv_blocks=64, max_model_len=256), str(model_dir),
                                          cost_params=cpu_params()),
                         [WorkloadRequest(None, None, 40, 6, arrival_time=0.0)]).records[0].token_times[-1]
    soon = gaps([2.0, 1.5], first_end + 0.001)  # idle 1 ms < warmup_idle_s: the second request starts warm
    assert soon[1] == pytest.approx(plain[1])
