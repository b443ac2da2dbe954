"""Unit tests for `pagedserve bench`: stream timing on a scripted clock, statistics on known timings,
/metrics parsing for pagedserve and vLLM names, sweeps and plots. No server, no sleeps."""
from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from pagedserve.bench.client import BenchTarget, RequestResult, consume_stream, request_body
from pagedserve.bench.metrics_scrape import parse_metrics, summarize_server_metrics, timeline
from pagedserve.bench.report import (format_summary, format_sweep, meets_slos, parse_goodput, peak_concurrency,
                                     summarize)
from pagedserve.bench.sweep import BenchConfig, parse_values, sweep_points
from pagedserve.bench.workloads import WorkloadRequest


class ScriptedClock:
    def __init__(self, times):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


async def _lines(chunks):
    for c in chunks:
        yield c.encode()


def completion_chunk(text, finish=None):
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}],
                                  "usage": None}) + "\n"


def consume(chunks, times, endpoint="completions", start=10.0):
    result = RequestResult(index=0, prompt_len=3)
    return asyncio.run(consume_stream(_lines(chunks), result, endpoint, start, ScriptedClock(times)))


def test_stream_timing_from_content_chunks_and_usage():
    chunks = [
        ": keep-alive comment\n", "\n",
        completion_chunk("He"), "\n",
        completion_chunk(""), "\n",            # a token whose text is empty still arrived (vLLM's rule)
        completion_chunk("llo"), "\n",
        completion_chunk(" world", "length"), "\n",
        "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}) + "\n",
        "data: [DONE]\n",
    ]
    # One clock reading per data payload, then one at the end of the stream.
    times = [10.25, 10.30, 10.40, 10.70, 10.71, 10.72, 10.75]
    r = consume(chunks, times)
    assert r.success and not r.error
    assert r.ttft == pytest.approx(0.25)
    assert r.itl == pytest.approx([0.05, 0.10, 0.30])   # 10.25 -> 10.30 -> 10.40 -> 10.70
    assert r.e2el == pytest.approx(0.75)
    assert r.num_chunks == 4
    assert r.generated_text == "Hello world"
    assert r.output_tokens == 5 and r.output_tokens_from_usage   # usage wins over the chunk count
    assert r.prompt_len == 7
    assert r.tpot == pytest.approx((0.75 - 0.25) / 4)
    assert r.token_times() == pytest.approx([r.start + 0.25, r.start + 0.30, r.start + 0.40, r.start + 0.70])


def test_stream_without_usage_counts_chunks():
    chunks = [completion_chunk("a"), completion_chunk("b"), completion_chunk("c", "stop"), "data: [DONE]\n"]
    r = consume(chunks, [11.0, 11.5, 12.5, 12.5, 12.6])
    assert r.success and r.output_tokens == 3 and not r.output_tokens_from_usage
    assert r.ttft == pytest.approx(1.0) and r.itl == pytest.approx([0.5, 1.0]) and r.e2el == pytest.approx(2.6)
    assert r.tpot == pytest.approx(1.6 / 2)


def test_chat_stream_reads_deltas():
    def delta(d, finish=None):
        return "data: " + json.dumps({"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}) + "\n"

    chunks = [delta({"role": "assistant", "content": ""}), delta({"content": "Hi"}), delta({"content": "!"}),
              delta({}, "stop"), "data: [DONE]\n"]
    r = consume(chunks, [10.1, 10.2, 10.3, 10.4, 10.4, 10.5], endpoint="chat")
    # Neither the role-only chunk nor the empty closing chunk carries a token.
    assert r.success and r.generated_text == "Hi!" and r.output_tokens == 2
    assert r.ttft == pytest.approx(0.2) and r.itl == pytest.approx([0.1])
    assert r.e2el == pytest.approx(0.5)


def test_empty_closing_chunk_is_not_a_token():
    # llama.cpp's shape: one chunk per token, then an empty chunk with the finish_reason, no usage.
    chunks = [completion_chunk("a"), completion_chunk("b"), completion_chunk("", "length"), "data: [DONE]\n"]
    r = consume(chunks, [10.5, 10.6, 10.7, 10.7, 10.8])
    assert r.success and r.output_tokens == 2 and r.itl == pytest.approx([0.1]) and r.e2el == pytest.approx(0.8)


def test_stream_error_payload_fails_the_request():
    chunks = [completion_chunk("a"), "data: " + json.dumps({"error": {"message": "boom", "code": 500}}) + "\n"]
    r = consume(chunks, [10.1, 10.2, 10.3])
    assert not r.success and r.error == "boom"
    r = consume(["data: [DONE]\n"], [10.1, 10.2])
    assert not r.success and "without any completion chunk" in r.error


def test_request_body_shapes():
    target = BenchTarget("http://127.0.0.1:1", "m", "completions")
    req = WorkloadRequest([20, 21, 22], None, 3, 8)
    body = request_body(target, req, 0)
    assert body["prompt"] == [20, 21, 22] and body["max_tokens"] == 8 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    chat = request_body(BenchTarget("http://x", "m", "chat"), req, 0)
    assert chat["messages"][0]["role"] == "user" and len(chat["messages"][0]["content"].split()) == 3
    text = request_body(target, WorkloadRequest(None, "hello", 1, 4, ignore_eos=False), 0)
    assert text["prompt"] == "hello" and "ignore_eos" not in text


def _known_results():
    """Four successful requests with hand-picked timings, one failure."""
    gaps_ms = np.arange(1, 101, dtype=float)  # 100 gaps, 1..100 ms, spread over 4 requests
    results = []
    for i in range(4):
        gaps = list(gaps_ms[i * 25:(i + 1) * 25] / 1000)
        ttft = (i + 1) * 0.1                      # 100, 200, 300, 400 ms
        e2el = ttft + sum(gaps)
        results.append(RequestResult(index=i, success=True, prompt_len=10 * (i + 1), output_tokens=26,
                                     output_tokens_from_usage=True, num_chunks=26, start=float(i),
                                     ttft=ttft, itl=gaps, e2el=e2el))
    results.append(RequestResult(index=4, success=False, error="HTTP 400: too long", prompt_len=999,
                                 start=0.5, e2el=0.01))
    return results


def test_summary_counts_and_percentiles_from_known_timings():
    results = _known_results()
    s = summarize(results, duration=10.0)
    assert s["successful_requests"] == 4 and s["failed_requests"] == 1
    assert s["total_input_tokens"] == 100 and s["total_output_tokens"] == 104   # the failure counts no tokens
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["output_throughput"] == pytest.approx(10.4)
    assert s["total_token_throughput"] == pytest.approx(20.4)
    # ITL over every measured gap (1..100 ms), linear interpolation as numpy's default.
    itl = s["itl_ms"]
    assert itl["mean"] == pytest.approx(50.5) and itl["median"] == pytest.approx(50.5)
    assert itl["p90"] == pytest.approx(90.1) and itl["p99"] == pytest.approx(99.01)
    ttft = s["ttft_ms"]
    assert ttft["mean"] == pytest.approx(250) and ttft["median"] == pytest.approx(250)
    assert ttft["p90"] == pytest.approx(370) and ttft["p99"] == pytest.approx(397)
    # TPOT per request = (e2e - ttft) / (tokens - 1) = sum(gaps) / 25
    tpots = [sum(r.itl) / 25 * 1000 for r in results[:4]]
    assert s["tpot_ms"]["mean"] == pytest.approx(np.mean(tpots))
    assert s["e2el_ms"]["p99"] == pytest.approx(np.percentile([r.e2el * 1000 for r in results[:4]], 99))
    assert s["errors"] == {"HTTP 400: too long": 1}
    text = format_summary(s)
    assert "Successful requests:" in text and "P99 ITL (ms):" in text and "99.01" in text


def test_goodput_and_slos():
    results = _known_results()
    assert parse_goodput(["ttft:250", "tpot:40"]) == {"ttft": 250.0, "tpot": 40.0}
    assert parse_goodput(["ttft:250,e2el:900"]) == {"ttft": 250.0, "e2el": 900.0}
    for bad in (["ttft"], ["foo:1"], ["ttft:x"], ["ttft:0"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)
    s = summarize(results, duration=10.0, slos={"ttft": 250})
    assert s["good_requests"] == 2 and s["request_goodput"] == pytest.approx(0.2)   # 100 and 200 ms TTFT
    assert not meets_slos(results[4], {})                                          # a failure is never good
    assert "Request goodput" in format_summary(s)


def test_peak_concurrency():
    def r(start, e2el):
        return RequestResult(index=0, success=True, start=start, e2el=e2el)

    assert peak_concurrency([r(0, 1), r(0.5, 1), r(0.9, 0.05), r(1.6, 1)]) == 3
    assert peak_concurrency([r(0, 1), r(1, 1)]) == 1   # one ends as the next starts
    assert peak_concurrency([]) == 0


def test_empty_summary_is_nan_not_crash():
    s = summarize([RequestResult(index=0, error="refused")], duration=1.0)
    assert s["successful_requests"] == 0 and math.isnan(s["ttft_ms"]["p99"])
    assert "n/a" in format_summary(s)


def test_one_report_builder_for_bench_and_sim():
    """Records (simulator, replay) and client results go through one builder: the simulator's
    flat vLLM keys carry exactly the bench's numbers, P95 included, checked against numpy."""
    from pagedserve.bench.report import RequestRecord, results_from_records, vllm_flat_keys
    from pagedserve.sim.report import compute_metrics

    records = [RequestRecord(str(i), arrival=float(i), prompt_len=8, output_len=4, first_token_time=i + 0.1 * (i + 1),
                             token_times=[i + 0.1 * (i + 1) + 0.02 * k * (i + 1) for k in range(4)],
                             finish=i + 0.1 * (i + 1) + 0.06 * (i + 1)) for i in range(5)]
    flat = compute_metrics(records, duration=10.0)
    nested = summarize(results_from_records(records), 10.0)
    assert vllm_flat_keys(nested) == {k: v for k, v in flat.items() if k.endswith("_ms")}
    ttft_ms = [100.0 * (i + 1) for i in range(5)]
    itl_ms = [20.0 * (i + 1) for i in range(5) for _ in range(3)]
    assert flat["p95_ttft_ms"] == pytest.approx(np.percentile(ttft_ms, 95))
    assert nested["itl_ms"]["p95"] == pytest.approx(np.percentile(itl_ms, 95))
    assert flat["median_e2el_ms"] == pytest.approx(np.median([160.0 * (i + 1) for i in range(5)]))


def test_empty_series_are_nan_in_every_shape():
    from pagedserve.bench.report import RequestRecord
    from pagedserve.sim.report import compute_metrics

    never_finished = [RequestRecord("0", arrival=0.0, prompt_len=8, output_len=4)]
    flat = compute_metrics(never_finished, duration=1.0)
    latency_keys = [k for k in flat if k.endswith("_ms")]
    assert len(latency_keys) == 4 * 7 and all(math.isnan(flat[k]) for k in latency_keys)
    nested = summarize([], duration=1.0)
    assert all(math.isnan(v) for name in ("ttft", "tpot", "itl", "e2el") for v in nested[f"{name}_ms"].values())


def test_bench_never_imports_sim():
    import subprocess
    import sys

    code = ("import sys, pkgutil, importlib, pagedserve.bench as b\n"
            "for m in pkgutil.iter_modules(b.__path__): importlib.import_module('pagedserve.bench.' + m.name)\n"
            "bad = [m for m in sys.modules if m.startswith(('pagedserve.sim', 'pagedserve.tune'))]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_simulator_timeline_speaks_the_exposed_names():
    """The simulated 'inside the server' timeline feeds the same plots as a scrape: same keys."""
    from pagedserve import metric_names as mn
    from pagedserve.bench.metrics_scrape import timeline
    from pagedserve.sim.simulator import Timeline

    simulated = set(Timeline().as_scraped()) - {"t"}
    assert simulated and simulated <= {spec.exposed for spec in mn.METRICS}
    scraped = set(timeline([parse_metrics(PAGEDSERVE_BEFORE)])) - {"t"}
    assert simulated <= scraped | {mn.NUM_REQUESTS_SWAPPED}   # the fixture has no swapped gauge


PAGEDSERVE_BEFORE = """
# TYPE pagedserve:kv_cache_usage_perc gauge
pagedserve:kv_cache_usage_perc{model_name="m"} 0.0
pagedserve:num_requests_running{model_name="m"} 0.0
pagedserve:num_requests_waiting{model_name="m"} 0.0
# TYPE pagedserve:num_preemptions counter
pagedserve:num_preemptions_total{mode="recompute",model_name="m"} 2.0
pagedserve:num_preemptions_total{mode="swap",model_name="m"} 1.0
# TYPE pagedserve:swapped_blocks counter
pagedserve:swapped_blocks_total{direction="out",model_name="m"} 4.0
pagedserve:swapped_blocks_total{direction="in",model_name="m"} 4.0
# TYPE pagedserve:prefix_cache_queries counter
pagedserve:prefix_cache_queries_total{model_name="m"} 100.0
# TYPE pagedserve:prefix_cache_hits counter
pagedserve:prefix_cache_hits_total{model_name="m"} 10.0
# TYPE pagedserve:time_to_first_token_seconds histogram
pagedserve:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0
pagedserve:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 3.0
pagedserve:time_to_first_token_seconds_count{model_name="m"} 3.0
pagedserve:time_to_first_token_seconds_sum{model_name="m"} 0.1
"""


def _pagedserve_text(kv, running, waiting, recompute, swap, out, in_, queries, hits):
    return (PAGEDSERVE_BEFORE
            .replace('kv_cache_usage_perc{model_name="m"} 0.0', f'kv_cache_usage_perc{{model_name="m"}} {kv}')
            .replace('num_requests_running{model_name="m"} 0.0', f'num_requests_running{{model_name="m"}} {running}')
            .replace('num_requests_waiting{model_name="m"} 0.0', f'num_requests_waiting{{model_name="m"}} {waiting}')
            .replace('mode="recompute",model_name="m"} 2.0', f'mode="recompute",model_name="m"}} {recompute}')
            .replace('mode="swap",model_name="m"} 1.0', f'mode="swap",model_name="m"}} {swap}')
            .replace('direction="out",model_name="m"} 4.0', f'direction="out",model_name="m"}} {out}')
            .replace('direction="in",model_name="m"} 4.0', f'direction="in",model_name="m"}} {in_}')
            .replace('queries_total{model_name="m"} 100.0', f'queries_total{{model_name="m"}} {queries}')
            .replace('hits_total{model_name="m"} 10.0', f'hits_total{{model_name="m"}} {hits}'))


def test_parse_pagedserve_metrics_and_summarise_a_run():
    before = parse_metrics(PAGEDSERVE_BEFORE, t=-0.1)
    assert before.value("num_preemptions") == 3
    assert before.by_label("num_preemptions", "mode") == {"recompute": 2, "swap": 1}
    assert before.histograms["time_to_first_token_seconds"].count == 3      # buckets stay a histogram
    assert before.value("time_to_first_token_seconds_bucket") is None
    during = [parse_metrics(_pagedserve_text(0.5, 4, 2, 2, 1, 4, 4, 200, 60), t=0.5),
              parse_metrics(_pagedserve_text(0.9, 8, 6, 5, 2, 10, 6, 300, 90), t=1.0)]
    after = parse_metrics(_pagedserve_text(0.1, 0, 0, 6, 2, 12, 12, 400, 130), t=1.5)
    s = summarize_server_metrics(before, after, during + [after])
    assert s["peak_kv_cache_usage_perc"] == pytest.approx(0.9)
    assert s["mean_kv_cache_usage_perc"] == pytest.approx(0.5)
    assert s["peak_num_requests_waiting"] == 6
    assert s["num_preemptions_total"] == 5
    assert s["preemptions_by_mode"] == {"recompute": 4, "swap": 1}
    assert s["swapped_blocks_by_direction"] == {"out": 8, "in": 8}
    assert s["prefix_cache_hit_rate"] == pytest.approx(120 / 300)
    series = timeline(during + [after])
    assert series["t"] == [0.5, 1.0, 1.5] and series["kv_cache_usage_perc"] == [0.5, 0.9, 0.1]


def test_parse_real_engine_metrics_render():
    from pagedserve.metrics import EngineMetrics

    m = EngineMetrics("tiny", 256, log_interval=0)
    m.set_state(running=3, waiting=1, swapped=0, used_blocks=5, total_blocks=10, block_size=16)
    snap = parse_metrics(m.render().decode())
    assert snap.value("kv_cache_usage_perc") == pytest.approx(0.5)
    assert snap.value("num_requests_running") == 3
    assert snap.value("num_preemptions") == 0 and snap.value("prefix_cache_hits") == 0


def test_parse_vllm_names():
    text = """
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="x"} 0.25
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="x"} 3.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="x"} 7.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="x"} 50.0
# TYPE other_metric gauge
other_metric 1.0
"""
    snap = parse_metrics(text)
    assert snap.gauges == {"kv_cache_usage_perc": 0.25, "num_requests_running": 3.0, "other_metric": 1.0}
    assert snap.counters == {"num_preemptions": 7.0, "prefix_cache_queries": 50.0}
    s = summarize_server_metrics(snap, snap, [snap])
    assert s["num_preemptions_total"] == 0 and s["peak_kv_cache_usage_perc"] == 0.25
    assert summarize_server_metrics(parse_metrics("other_metric 1\n"), snap, [snap]) is None


LLAMACPP_TEXT = """# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.5
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 120
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 300
"""


def test_parse_llamacpp_names():
    text = LLAMACPP_TEXT
    snap = parse_metrics(text, t=2.0)
    assert snap.t == 2.0
    assert snap.gauges == {"kv_cache_usage_perc": 0.5, "num_requests_running": 2, "num_requests_waiting": 1}
    assert snap.counters == {"generation_tokens": 120, "prompt_tokens": 300}
    empty = parse_metrics(text.replace(" 120", " 0").replace(" 300", " 0"))
    s = summarize_server_metrics(empty, snap, [snap])
    assert s["generation_tokens_total"] == 120 and s["peak_num_requests_waiting"] == 1


def test_one_snapshot_for_bench_and_advise():
    """bench and advise read the same parser: counters lose `_total` in the snapshot, and the
    bench's summary speaks of them by their exposed name (with `_total`), from the names table."""
    from pagedserve import metric_names
    from pagedserve.bench import metrics_scrape, prom
    from pagedserve.advise import advisor

    assert metrics_scrape.parse_metrics is prom.parse_metrics and advisor.Snapshot is prom.Snapshot
    from pagedserve.metrics import EngineMetrics

    snap = parse_metrics(EngineMetrics("m", 64, log_interval=0).render().decode())
    assert snap.counters["num_preemptions"] == 0 and "num_preemptions_total" not in snap.counters
    s = summarize_server_metrics(snap, snap, [snap])
    for counter in metrics_scrape.COUNTERS:
        assert metric_names.exposed(counter) in s, counter
    assert metric_names.exposed("num_preemptions") == "num_preemptions_total"
    assert metric_names.exposed("iteration_tokens_total") == "iteration_tokens_total"  # a histogram
    with pytest.raises(KeyError, match="not a pagedserve metric"):
        metric_names.exposed("num_preemption")


def test_names_table_aliases_are_unambiguous():
    from pagedserve import metric_names as mn

    for old, (new, naming) in mn.ALIASES.items():
        assert old not in mn.SPECS and new in mn.SPECS and naming in ("vllm", "vllm-v0", "llamacpp")
    # vLLM's older names for the ITL histogram and the KV gauge read as the new ones.
    assert mn.ALIASES["time_per_output_token_seconds"][0] == "inter_token_latency_seconds"
    assert mn.ALIASES["gpu_cache_usage_perc"][0] == "kv_cache_usage_perc"


def test_parse_values_and_sweep_points():
    assert parse_values("1,2,4", float, "request_rate") == [1.0, 2.0, 4.0]
    assert parse_values("inf", float, "request_rate") == [math.inf]
    assert parse_values(None, int, "max_concurrency") == [None]
    for bad in ("0", "a,b", "-1"):
        with pytest.raises(ValueError, match="request_rate"):
            parse_values(bad, float, "request_rate")
    base = BenchConfig(target=BenchTarget("http://x", "m"))
    knob, points = sweep_points(base, [math.inf], [1, 4, 16])
    assert knob == "max_concurrency" and [c.max_concurrency for _, c in points] == [1, 4, 16]
    knob, points = sweep_points(base, [1.0, 2.0], [None])
    assert knob == "request_rate" and [label for label, _ in points] == ["1", "2"]
    knob, points = sweep_points(base, [3.0], [8])
    assert knob is None and points[0][1].request_rate == 3.0 and points[0][1].max_concurrency == 8
    with pytest.raises(ValueError, match="one knob"):
        sweep_points(base, [1.0, 2.0], [1, 2])


def test_sweep_table_and_plots(tmp_path):
    from pagedserve.bench.plots import plot_run, plot_sweep

    results = _known_results()
    s1 = summarize(results, 10.0, server={"num_preemptions_total": 3.0})
    s2 = summarize(results[:2], 5.0)
    table = format_sweep("max_concurrency", [("1", s1), ("4", s2)])
    lines = table.splitlines()
    assert "max_concurrency" in lines[0] and "P99 TTFT ms" in lines[0] and len(lines) == 4
    assert lines[2].split()[-1] == "3" and lines[3].split()[-1] == "n/a"
    series = {"t": [0.0, 0.5, 1.0], "kv_cache_usage_perc": [0.1, 0.8, 0.2], "num_requests_running": [1, 4, 2],
              "num_preemptions_total": [0, 1, 3]}
    paths = plot_run(results, series, 10.0, tmp_path / "run")
    paths.append(plot_sweep("max_concurrency", [("1", s1), ("4", s2)], tmp_path))
    for p in paths:
        assert p.exists() and p.stat().st_size > 1000


def _full_and_sampled(text):
    from pagedserve.bench.metrics_scrape import SAMPLED

    return parse_metrics(text), parse_metrics(text, only=SAMPLED)


def test_sampled_parse_reads_the_same_gauges_and_counters_under_every_naming():
    """Mid-run scrapes parse only the families the summary and the timeline read (a full parse of
    pagedserve's ~600 histogram buckets held the bench's token-stamping loop ~10-14 ms every 0.5 s):
    the values must be the full parse's, for pagedserve, vLLM (V1 and V0 names) and llama.cpp."""
    from pathlib import Path

    from pagedserve.bench.metrics_scrape import BREAKDOWNS, SAMPLED

    fixtures = sorted((Path(__file__).parent / "fixtures" / "metrics").glob("*.txt"))
    assert len(fixtures) >= 30
    from pagedserve.metrics import EngineMetrics

    texts = [f.read_text() for f in fixtures] + [LLAMACPP_TEXT]
    for names in ("pagedserve", "vllm", "both"):  # a live render under each --metric-names
        m = EngineMetrics("m", 1024, log_interval=0, names=names)
        m.set_state(running=3, waiting=1, swapped=0, used_blocks=5, total_blocks=10, block_size=16)
        texts.append(m.render().decode())
    for text in texts:
        full, sampled = _full_and_sampled(text)
        assert any(full.value(n) is not None for n in SAMPLED)
        for name in SAMPLED:
            assert sampled.value(name) == full.value(name), name
        for name, label, _ in BREAKDOWNS:
            assert sampled.by_label(name, label) == full.by_label(name, label)
        assert sampled.naming == full.naming
        assert not sampled.histograms


def test_mid_run_samples_skip_histograms_before_and_after_stay_whole(monkeypatch):
    """MetricsSampler against a scripted session serving a real engine render: the samples taken
    while the run streams hold no histograms (their buckets were never parsed) and the same
    gauges as a full parse; the scrape before the run keeps everything."""
    from pagedserve.bench import metrics_scrape
    from pagedserve.metrics import EngineMetrics

    m = EngineMetrics("m", 1024, log_interval=0)
    m.set_state(running=3, waiting=1, swapped=0, used_blocks=5, total_blocks=10, block_size=16)
    text = m.render().decode()

    class Response:
        status = 200

        async def text(self):
            return text

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

    class Session:
        def __init__(self, *args, **kwargs):
            pass

        def get(self, url):
            return Response()

        async def close(self):
            pass

    monkeypatch.setattr(metrics_scrape.aiohttp, "ClientSession", Session)

    async def run():
        sampler = metrics_scrape.MetricsSampler("http://127.0.0.1:1", interval=0)
        await sampler.start()
        sampler.mark_run_start(0.0)
        for _ in range(5):
            await asyncio.sleep(0)
        await sampler.stop()
        return sampler

    sampler = asyncio.run(run())
    full = parse_metrics(text)
    assert full.histograms and sampler.before.histograms.keys() == full.histograms.keys()
    during = sampler.samples[:-1]
    assert during
    for snap in during:
        assert not snap.histograms
        assert snap.value("num_requests_running") == 3 and snap.value("kv_cache_usage_perc") == pytest.approx(0.5)
    assert sampler.after.histograms.keys() == full.histograms.keys()
