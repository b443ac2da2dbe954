"""pagedserve tune: front and sweet-spot logic on hand-made points, and a small simulated sweep."""
from __future__ import annotations

import json
import math

import pytest

from pagedserve.cli import main
from pagedserve.tune import tuner


def pt(seqs, tput, ttft, itl, preempt=0.0):
    return tuner.PointResult({"max_num_seqs": seqs}, tput, tput / 100, ttft, itl, itl, ttft + 1000, preempt, 0.9)


def scored(points, slos):
    for p in points:
        p.tail = tuner.tail_score(p, slos)
    tuner.mark_front(points)
    return points


def test_front_and_sweet_spot_by_hand():
    slos = {"ttft_p99": 1000.0, "itl_p99": 50.0}
    a, b, c, d, e = points = scored([
        pt(8, 500, 200, 20),         # tail 0.4: slow but safe
        pt(16, 900, 400, 30),        # tail 0.6
        pt(32, 1200, 900, 45),       # tail 0.9: best feasible
        pt(64, 1300, 3000, 80),      # tail 3.0: fastest, misses the SLO
        pt(48, 1100, 950, 48),       # dominated by c (less throughput, more tail)
    ], slos)
    assert [p.on_front for p in points] == [True, True, True, True, False]
    chosen, _ = tuner.choose_sweet_spot(points, slos, max_preemption_rate=0.05)
    assert chosen is c and c.meets_slo and not d.meets_slo
    # Too many preemptions disqualifies an otherwise best point.
    c.preemptions_per_request = 0.5
    chosen, _ = tuner.choose_sweet_spot(points, slos, max_preemption_rate=0.05)
    assert chosen is e  # the next best feasible, front or not
    # Nothing feasible: no sweet spot, and the reason says so.
    chosen, why = tuner.choose_sweet_spot(scored([pt(64, 1300, 3000, 80)], slos), slos, 0.05)
    assert chosen is None and "no point meets" in why


def test_ties_prefer_lower_tail_then_fewer_seqs():
    slos = {"itl_p99": 100.0}
    points = scored([pt(64, 1000, 0, 60), pt(32, 995, 0, 40), pt(128, 999, 0, 40)], slos)
    chosen, _ = tuner.choose_sweet_spot(points, slos, 0.05)
    assert chosen.knobs == {"max_num_seqs": 32}


def test_grid_parsing_and_pruning():
    grid = tuner.parse_sweep(["max_num_seqs=8,64,512", "enable_chunked_prefill=on,off",
                              "max-num-batched-tokens=256"])
    points, pruned = tuner.expand_grid(grid, max_num_seqs_bound=100, max_model_len=1024)
    assert all(p["max_num_seqs"] <= 125 for p in points) and len(pruned) == 2
    unchunked = [p for p in points if not p["enable_chunked_prefill"]]
    assert all(p["max_num_batched_tokens"] == 1024 for p in unchunked)
    with pytest.raises(ValueError, match="cannot be swept"):
        tuner.parse_sweep(["model=x"])
    with pytest.raises(ValueError, match="slo"):
        tuner.parse_slos(["p99:5"])


def test_simulated_sweep_picks_a_front_point_within_slo(tmp_path, capsys):
    out = tmp_path / "tune.json"
    rc = main(["tune", "--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--workload", "random",
               "--random-input-len", "512", "--random-output-len", "128", "--num-prompts", "120",
               "--request-rate", "40", "--seed", "1",
               "--sweep", "max_num_seqs=2,8,32,128", "--sweep", "max_num_batched_tokens=2048",
               "--slo", "ttft_p99:2000", "itl_p99:60", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    chosen = data["chosen"]
    assert chosen is not None
    row = next(p for p in data["simulated"] if p["knobs"] == chosen)
    assert row["on_front"] and row["meets_slo"]
    assert row["p99_ttft_ms"] <= 2000 and row["p99_itl_ms"] <= 60
    # Starving concurrency cannot be the answer under this load: it queues past the TTFT SLO.
    starved = next(p for p in data["simulated"] if p["knobs"]["max_num_seqs"] == 2)
    assert not starved["meets_slo"] and not math.isclose(starved["output_throughput"], row["output_throughput"])
    assert "pagedserve serve --model llama-3.1-8b" in capsys.readouterr().out


def test_real_sweep_on_a_calibrated_cpu_model(tiny_llama, tmp_path, capsys):
    """The loop on this CPU: trace the real engine, calibrate, tune on the simulator, and run the
    same points on the real engine (--real)."""
    from pagedserve import LLM, SamplingParams

    trace = tmp_path / "steps.jsonl"
    llm = LLM(str(tiny_llama), num_kv_blocks=128, max_model_len=256, step_trace_path=str(trace))
    llm.generate([[5] * n for n in (10, 40, 80, 120)], SamplingParams(max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    cost = tmp_path / "cost.json"
    assert main(["simulate", "calibrate", "--trace", str(trace), "--model", str(tiny_llama), "--out", str(cost)]) == 0
    out = tmp_path / "tune.json"
    rc = main(["tune", "--device", "cpu", "--model", str(tiny_llama), "--cost-model", str(cost),
               "--num-kv-blocks", "128", "--max-model-len", "256", "--workload", "random",
               "--random-input-len", "40", "--random-output-len", "8", "--num-prompts", "6", "--request-rate", "50",
               "--sweep", "max_num_seqs=1,4", "--real", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    real, simulated = data["real"], data["simulated"]
    assert [p["knobs"] for p in real] == [p["knobs"] for p in simulated] == \
        [{"max_num_seqs": 1}, {"max_num_seqs": 4}]
    for p in real:
        assert not p["error"] and p["failed"] == 0
        # all 6 requests ran on the real engine and each made exactly its 8 tokens:
        # output tokens per second = 8 x requests per second over the same measured duration
        assert p["request_throughput"] > 0
        assert p["output_throughput"] == pytest.approx(8 * p["request_throughput"])
        assert 0 < p["p99_ttft_ms"] <= p["p99_e2el_ms"] and p["p99_itl_ms"] > 0
        assert p["preemptions_per_request"] == 0  # 128 blocks hold every request whole
        assert p["meets_slo"] and math.isfinite(p["tail"])  # no SLO given: every point qualifies
    printed = capsys.readouterr().out
    assert "real engine:" in printed and "simulated:" in printed
    assert "real engine's sweet spot: {'max_num_seqs':" in printed


FLEET_RUN = ["--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--max-num-seqs", "8", "--max-model-len", "288",
             "--workload", "random", "--random-input-len", "256", "--random-output-len", "32",
             "--num-prompts", "60", "--seed", "1"]


def test_tune_sizes_the_fleet_more_replicas_for_a_higher_arrival_rate(tmp_path, capsys):
    """`tune --replicas 1,2,4 --router ...`: under one SLO, the fewest replicas meeting it, more at a
    higher rate; each pick checked against `simulate --replicas N` run on its own: the chosen count
    meets the SLO there and every smaller count swept misses it."""
    def p99_ttft(rate, replicas, router):
        out = tmp_path / f"sim-{rate}-{replicas}-{router}.json"
        assert main(["simulate", *FLEET_RUN, "--request-rate", str(rate), "--replicas", str(replicas),
                     "--router", router, "--result-json", str(out)]) == 0
        return json.loads(out.read_text())["p99_ttft_ms"]

    slo = 100.0
    picks = {}
    for rate in (5, 80):
        out = tmp_path / f"tune-{rate}.json"
        assert main(["tune", *FLEET_RUN, "--request-rate", str(rate), "--replicas", "4,1,2",
                     "--router", "kv-aware,round-robin", "--slo", f"ttft_p99:{slo:g}", "--json", str(out)]) == 0
        data = json.loads(out.read_text())
        assert len(data["simulated"]) == 6   # 3 counts x 2 routers
        chosen = data["chosen"]
        picks[rate] = chosen["replicas"]
        assert p99_ttft(rate, chosen["replicas"], chosen["router"]) <= slo
        for smaller in (n for n in (1, 2, 4) if n < chosen["replicas"]):
            for router in ("kv-aware", "round-robin"):
                assert p99_ttft(rate, smaller, router) > slo, (rate, smaller, router)
        assert f"--replicas {chosen['replicas']} --router {chosen['router']}" in capsys.readouterr().out
    assert picks[80] > picks[5], picks
    with pytest.raises(ValueError, match="replicas"):
        tuner.parse_fleet("0,2", None)
    with pytest.raises(ValueError, match="router"):
        tuner.parse_fleet("1,2", "random")
    with pytest.raises(ValueError, match="router"):
        tuner.parse_fleet(None, "kv-aware")


def test_tune_starts_from_vllms_default_seqs_on_a_preset_unless_swept_or_given(monkeypatch, capsys):
    """Points that do not set max_num_seqs run vLLM's default for the device, as `simulate` and
    `plan` take it (1,024 on an H100, 256 on an A100); a swept or given value is kept."""
    import pagedserve.sim.simulator as simulator

    built = []
    real = simulator.build_deployment

    def recording(config, *a, **kw):
        dep = real(config, *a, **kw)
        built.append(dep.config.max_num_seqs)
        return dep

    monkeypatch.setattr(simulator, "build_deployment", recording)
    run = ["tune", "--model", "llama-3.1-8b", "--workload", "random", "--random-input-len", "64",
           "--random-output-len", "2", "--num-prompts", "2", "--request-rate", "10"]
    for extra, want in ((["--gpu", "H100-SXM", "--layouts", "TP1"], {1024}),
                        (["--gpu", "A100-80GB", "--layouts", "TP1"], {256}),
                        (["--gpu", "H100-SXM", "--layouts", "TP1", "--max-num-seqs", "48"], {48}),
                        (["--gpu", "H100-SXM", "--sweep", "max_num_seqs=8,32"], {1024, 8, 32})):
        built.clear()
        assert main(run + extra) == 0
        assert set(built) == want, extra
    capsys.readouterr()
