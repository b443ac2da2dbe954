"""/metrics: parses with prometheus_client, counters and histograms move by known amounts."""
from __future__ import annotations

import json
import logging
import pathlib
import re
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.config import EngineConfig
from pagedserve.engine import LLM
from pagedserve import metric_names
from pagedserve.metrics import EngineMetrics, build_1_2_5_buckets, token_count_buckets
from pagedserve.sampling import SamplingParams
from pagedserve.server.launcher import ServerThread, build_server
from metrics_scrape import scrape, wait_idle

EXPECTED = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge", "num_requests_swapped": "gauge",
    "kv_cache_usage_perc": "gauge", "kv_cache_total_tokens": "gauge", "kv_cache_used_tokens": "gauge",
    "engine_busy_ratio": "gauge", "kv_cache_bytes_per_token": "gauge", "cache_config_info": "gauge",
    "num_preemptions": "counter", "prompt_tokens": "counter", "generation_tokens": "counter",
    "request_success": "counter", "prefix_cache_queries": "counter", "prefix_cache_hits": "counter",
    "recomputed_tokens": "counter", "swapped_blocks": "counter", "kv_events": "counter",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
    "request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
    "iteration_tokens_total": "histogram", "request_num_preemptions": "histogram",
    "engine_step_seconds": "histogram",
    "structured_output_errors": "counter", "grammar_cache_entries": "gauge", "grammar_cache_bytes": "gauge",
    "engine_stalls": "counter", "engine_stalled": "gauge",
    "dp_engine_num_requests_running": "gauge", "dp_engine_num_requests_waiting": "gauge",
    "dp_engine_kv_cache_usage_perc": "gauge",
    "external_prefix_cache_queries": "counter", "external_prefix_cache_hits": "counter",
    "kv_offload_total_bytes": "counter", "kv_offload_blocks": "counter", "kv_offload_cpu_cache_usage_perc": "gauge",
    "prefix_cache_evicted_hits": "counter",
}
# Small pool on purpose: 8 blocks of 16, and one request may need 4 (max_model_len 64).
CONFIG = dict(num_kv_blocks=8, block_size=16, max_model_len=64, max_num_seqs=4, enable_prefix_caching=True,
              preemption_mode="recompute")


@pytest.fixture(scope="module")
def server(tiny_llama):
    app, async_engine = build_server(EngineConfig(model=str(tiny_llama), **CONFIG), log_interval=0.2)
    with ServerThread(app) as st:
        st.async_engine = async_engine
        yield st


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(server):
    return server.async_engine.engine.model_name


def families(server):
    return {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}


def delta(after: dict, before: dict, key: str) -> float:
    return after[key] - before.get(key, 0.0)


def test_every_metric_is_exposed_with_its_type(server):
    fams = families(server)
    for name, kind in EXPECTED.items():
        assert fams["pagedserve:" + name].type == kind, name
    m = scrape(server)
    assert m["pagedserve:kv_cache_total_tokens{}"] == 8 * 16
    # tiny_llama in fp32: K and V x 2 layers x 2 KV heads x head_dim 16 x 4 bytes
    assert m["pagedserve:kv_cache_bytes_per_token{}"] == 2 * 2 * 2 * 16 * 4
    assert m["pagedserve:cache_config_info{block_size=16,cache_dtype=float32,device=cpu,num_blocks=8}"] == 1
    assert "pagedserve:num_preemptions_total{mode=recompute}" in m
    # Our bounds: 24 per decade where TTFT and ITL live (vLLM has none between 10 and 25 ms ITL),
    # up to vLLM's top bound.
    ttft = bounds(m, "time_to_first_token_seconds")
    assert [b for b in ttft if 0.1 <= b <= 0.2] == [0.1, 0.11, 0.12, 0.13, 0.15, 0.16, 0.18, 0.2]
    assert ttft[-2:] == [2560.0, float("inf")]
    itl = bounds(m, "inter_token_latency_seconds")
    assert [b for b in itl if 0.01 <= b <= 0.025] == [0.01, 0.011, 0.012, 0.013, 0.015, 0.016, 0.018, 0.02, 0.022,
                                                      0.024]
    for latency, top in (("time_to_first_token_seconds", 100), ("inter_token_latency_seconds", 1),
                         ("e2e_request_latency_seconds", 300)):
        dense = [b for b in bounds(m, latency) if 0.01 <= b <= top]
        assert max(b / a for a, b in zip(dense, dense[1:])) <= 1.16, latency
    # Token counts: every integer to 10, then E24 (7-15% apart), ending at max_model_len (64).
    assert bounds(m, "request_prompt_tokens") == [*range(1, 11), 11, 12, 13, 15, 16, 18, 20, 22, 24, 27, 30, 33,
                                                  36, 39, 43, 47, 51, 56, 62, 64, float("inf")]
    assert bounds(m, "request_num_preemptions")[:11] == [float(n) for n in range(11)]


def bounds(scraped: dict, histogram: str) -> list[float]:
    prefix = f"pagedserve:{histogram}_bucket"
    return sorted(float(k.split("le=")[1].rstrip("}")) for k in scraped if k.startswith(prefix))


def test_exposed_families_are_the_names_table(server):
    """metrics.py builds from metric_names: the table and the exposition agree both ways."""
    fams = families(server)
    ours = {name.removeprefix("pagedserve:") for name in fams if name.startswith("pagedserve:")}
    assert ours == set(metric_names.SPECS) == set(EXPECTED)
    for spec in metric_names.METRICS:
        assert fams["pagedserve:" + spec.name].type == spec.kind, spec.name


def test_counters_and_histograms_move_by_known_amounts(server, client, model):
    before = wait_idle(server)
    r = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    n_prompt, n_gen = r.usage.prompt_tokens, r.usage.completion_tokens
    assert n_gen == 7
    after = wait_idle(server)
    assert delta(after, before, "pagedserve:prompt_tokens_total{}") == n_prompt
    assert delta(after, before, "pagedserve:generation_tokens_total{}") == n_gen
    assert delta(after, before, "pagedserve:request_success_total{finished_reason=length}") == 1
    assert delta(after, before, "pagedserve:request_success_total{finished_reason=stop}") == 0
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prompt_tokens", "request_generation_tokens", "request_num_preemptions"):
        assert delta(after, before, f"pagedserve:{h}_count{{}}") == 1, h
    assert delta(after, before, "pagedserve:request_prompt_tokens_sum{}") == n_prompt
    assert delta(after, before, "pagedserve:request_generation_tokens_sum{}") == n_gen
    assert delta(after, before, "pagedserve:inter_token_latency_seconds_count{}") == n_gen - 1
    # one prefill step plus one step per further token, each a batch of this request alone
    assert delta(after, before, "pagedserve:iteration_tokens_total_count{}") == n_gen
    assert delta(after, before, "pagedserve:iteration_tokens_total_sum{}") == n_prompt + n_gen - 1
    assert delta(after, before, "pagedserve:engine_step_seconds_count{}") == n_gen
    assert delta(after, before, "pagedserve:prefix_cache_queries_total{}") == n_prompt
    assert 0 <= after["pagedserve:engine_busy_ratio{}"] <= 1
    assert after["pagedserve:kv_cache_usage_perc{}"] == 0


def buckets(samples: dict, name: str) -> dict[float, float]:
    """{upper bound: cumulative count} of one histogram's _bucket series."""
    prefix = f"pagedserve:{name}_bucket{{le="
    return {float(k[len(prefix):-1]): v for k, v in samples.items() if k.startswith(prefix)}


def bucket_deltas(after: dict, before: dict, name: str) -> dict[float, float]:
    b = buckets(before, name)
    return {le: v - b.get(le, 0.0) for le, v in buckets(after, name).items()}


def assert_one_observation_in_place(deltas: dict[float, float], value: float, name: str) -> None:
    """One observation of `value`: exactly the buckets with le >= value moved, each by 1."""
    for le, d in deltas.items():
        assert d == (1 if value <= le else 0), (name, le, d, value)


def test_histograms_put_known_values_in_the_right_buckets_and_seconds(server, model):
    """A streamed request alone on the server, with a 10-token prompt and 6 generated tokens (on a
    bucket bound and one past one, so an off-by-one either way moves a bucket): which _bucket series
    move is known exactly for the token histograms and the per-step histogram; the latency
    histograms hold seconds that fit inside what the client measured around them."""
    before = wait_idle(server)
    start = time.perf_counter()
    first_chunk = None
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": list(range(20, 30)), "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and first_chunk is None:
                first_chunk = time.perf_counter()
    client_e2e, client_ttft = time.perf_counter() - start, first_chunk - start
    after = wait_idle(server)

    assert_one_observation_in_place(bucket_deltas(after, before, "request_prompt_tokens"), 10, "prompt")
    assert_one_observation_in_place(bucket_deltas(after, before, "request_generation_tokens"), 6, "generation")
    assert_one_observation_in_place(bucket_deltas(after, before, "request_num_preemptions"), 0, "preemptions")
    # One step of 10 prompt tokens, then five steps of one decode token each.
    steps = bucket_deltas(after, before, "iteration_tokens_total")
    assert steps == {le: (5 if le < 10 else 6) for le in steps}
    assert delta(after, before, "pagedserve:iteration_tokens_total_sum{}") == 10 + 5

    ttft = delta(after, before, "pagedserve:time_to_first_token_seconds_sum{}")
    e2e = delta(after, before, "pagedserve:e2e_request_latency_seconds_sum{}")
    queue = delta(after, before, "pagedserve:request_queue_time_seconds_sum{}")
    itl = delta(after, before, "pagedserve:inter_token_latency_seconds_sum{}")
    # Seconds, measured inside the client's own interval (milliseconds would be 1000x too big).
    assert 0 < ttft <= client_ttft and 0 < e2e <= client_e2e and 0 <= queue <= ttft <= e2e
    # The five gaps between six tokens add up to the time from the first token to the end.
    assert delta(after, before, "pagedserve:inter_token_latency_seconds_count{}") == 5
    # (abs: the finish time is read a moment after the last token's, and a busy CI box may
    # deschedule the engine thread in between)
    assert itl == pytest.approx(e2e - ttft, abs=0.02)
    for name, value in (("time_to_first_token_seconds", ttft), ("e2e_request_latency_seconds", e2e),
                        ("request_queue_time_seconds", queue)):
        assert_one_observation_in_place(bucket_deltas(after, before, name), value, name)
    # The six engine steps ran inside the client's interval: their seconds add up to less than it
    # (milliseconds would be 1000x too big), and every one sits in the buckets at or above their sum.
    step_sum = delta(after, before, "pagedserve:engine_step_seconds_sum{}")
    assert delta(after, before, "pagedserve:engine_step_seconds_count{}") == 6
    assert 0 < step_sum <= client_e2e
    assert_observations_at_most(bucket_deltas(after, before, "engine_step_seconds"), step_sum, 6, "engine_step")
    assert_observations_at_most(bucket_deltas(after, before, "inter_token_latency_seconds"), itl, 5, "itl")


def assert_observations_at_most(deltas: dict[float, float], bound: float, count: int, name: str) -> None:
    """`count` observations, none above `bound`: every bucket with le >= bound holds all of them."""
    assert deltas[float("inf")] == count, name
    for le, d in deltas.items():
        assert 0 <= d <= count and (le < bound or d == count), (name, le, d, bound)


def histogram_samples(metrics: EngineMetrics, name: str) -> tuple[float, float, dict[float, float]]:
    """(sum, count, {le: cumulative count}) of one histogram, as /metrics renders it."""
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples = fams["pagedserve:" + name].samples
    value = {s.name.rsplit("_", 1)[1]: s.value for s in samples if not s.name.endswith("_bucket")}
    return value["sum"], value["count"], {float(s.labels["le"]): s.value for s in samples
                                          if s.name.endswith("_bucket")}


def test_every_histogram_holds_known_observations_in_its_unit():
    """Each histogram of the names table gets known observations through the calls the engine
    makes (a 12.3 ms step of 7 tokens; a request that arrived at t=100 s, was first scheduled 40 ms
    later, had its first token at 250 ms, two more 50 ms after that, and finished at 1.3 s after
    2 preemptions): its _sum is their sum and each _bucket counts those <= its bound, in seconds for
    durations and in tokens or preemptions for counts. A histogram added to the table without a
    line here fails the test."""
    from pagedserve.core.outputs import RequestMetrics, SchedulerStats

    m = EngineMetrics("m", 64, log_interval=0, max_num_batched_tokens=32)
    m.record_step(SchedulerStats(num_batched_tokens=7), duration=0.0123, forward_time=0.01, num_batched_tokens=7)
    m.record_first_token(num_prompt_tokens=10, arrival=100.0, first_token=100.25)
    m.record_new_tokens(1, None)
    m.record_new_tokens(2, 0.05)  # two tokens in one step share the 50 ms gap: 25 ms each
    m.record_finished("length", 10, 3, RequestMetrics(arrival_time=100.0, first_scheduled_time=100.04,
                                                      first_token_time=100.25, last_token_time=101.3,
                                                      finished_time=101.3, num_preemptions=2, num_cached_tokens=0))
    observed = {
        metric_names.ENGINE_STEP: [0.0123],
        metric_names.ITERATION_TOKENS: [7],
        metric_names.TIME_TO_FIRST_TOKEN: [0.25],
        metric_names.INTER_TOKEN_LATENCY: [0.025, 0.025],
        metric_names.E2E_REQUEST_LATENCY: [1.3],
        metric_names.REQUEST_QUEUE_TIME: [0.04],
        metric_names.REQUEST_PROMPT_TOKENS: [10],
        metric_names.REQUEST_GENERATION_TOKENS: [3],
        metric_names.REQUEST_NUM_PREEMPTIONS: [2],
    }
    assert set(observed) == {s.name for s in metric_names.METRICS if s.kind == "histogram"}
    for name, values in observed.items():
        total, count, cumulative = histogram_samples(m, name)
        assert count == len(values) and total == pytest.approx(sum(values), abs=1e-9), (name, total)
        assert cumulative[float("inf")] == len(values), name
        for le, n in cumulative.items():
            assert n == sum(v <= le for v in values), (name, le, n, values)
        assert min(cumulative.values()) == 0, name  # some bound lies below the values: a unit error moves them


def test_prefix_cache_hits(server, client, model):
    prompt = "Paged attention keeps the KV cache in fixed-size blocks handed out as tokens grow."
    client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    before = wait_idle(server)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    after = wait_idle(server)
    assert r.usage.prompt_tokens > 16
    assert delta(after, before, "pagedserve:prefix_cache_queries_total{}") == r.usage.prompt_tokens
    assert delta(after, before, "pagedserve:prefix_cache_hits_total{}") >= 16
    assert after["pagedserve:kv_cache_usage_perc{}"] == 0  # cached blocks are free (evictable)


CONTENDED = ["def fibonacci(n):", "The quick brown fox", "import os", "class Scheduler:"]


def run_contended(server, client, model) -> tuple[list[str], dict, dict]:
    """Four requests of ~50 tokens need 16 blocks from a pool of 8: some must be preempted."""
    before = wait_idle(server)
    results: dict[int, str] = {}

    def call(i: int) -> None:
        r = client.completions.create(model=model, prompt=CONTENDED[i], max_tokens=44, temperature=0,
                                      extra_body={"ignore_eos": True})
        results[i] = r.choices[0].text

    ae = server.async_engine
    ae.pause()  # all four arrive before the first step, so they really compete for the pool
    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        end = time.monotonic() + 30
        while ae.num_waiting < 4:
            assert time.monotonic() < end, f"only {ae.num_waiting} of 4 requests arrived"
            time.sleep(0.02)
    finally:
        ae.resume()
    for t in threads:
        t.join()
    return [results[i] for i in range(4)], before, wait_idle(server)


@pytest.fixture(scope="module")
def expected_contended(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, max_model_len=64)
    outs = llm.generate(CONTENDED, SamplingParams(temperature=0, max_tokens=44, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_recompute_preemption_counters_and_output_unchanged(server, client, model, expected_contended):
    texts, before, after = run_contended(server, client, model)
    preempted = delta(after, before, "pagedserve:num_preemptions_total{mode=recompute}")
    assert preempted > 0
    assert delta(after, before, "pagedserve:num_preemptions_total{mode=swap}") == 0
    assert delta(after, before, "pagedserve:recomputed_tokens_total{}") > 0
    # every preemption belongs to a request that then finished
    assert delta(after, before, "pagedserve:request_num_preemptions_sum{}") == preempted
    assert after["pagedserve:kv_cache_usage_perc{}"] == 0 and after["pagedserve:num_requests_running{}"] == 0
    assert texts == expected_contended


@pytest.fixture(scope="module")
def swap_server(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), **{**CONFIG, "preemption_mode": "swap", "swap_space": "1MiB"})
    app, async_engine = build_server(config)
    with ServerThread(app) as st:
        st.async_engine = async_engine
        yield st


def test_swap_preemption_counters_and_output_unchanged(swap_server, model, expected_contended):
    client = openai.OpenAI(base_url=swap_server.url + "/v1", api_key="unused", max_retries=0)
    texts, before, after = run_contended(swap_server, client, model)
    preempted = delta(after, before, "pagedserve:num_preemptions_total{mode=swap}")
    assert preempted > 0
    out = delta(after, before, "pagedserve:swapped_blocks_total{direction=out}")
    assert out > 0 and delta(after, before, "pagedserve:swapped_blocks_total{direction=in}") == out
    assert delta(after, before, "pagedserve:request_num_preemptions_sum{}") == preempted
    assert after["pagedserve:num_requests_swapped{}"] == 0 and after["pagedserve:kv_cache_used_tokens{}"] == 0
    assert texts == expected_contended


def test_periodic_log_line(server, client, model, caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.metrics"):
        client.completions.create(model=model, prompt="abc", max_tokens=30, temperature=0,
                                  extra_body={"ignore_eos": True})
        end = time.monotonic() + 30
        while not any("Avg prompt throughput" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < end, "no stats line was logged"
            time.sleep(0.05)
    line = next(r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage())
    for part in ("generation throughput", "Running:", "Waiting:", "Swapped:", "KV cache usage:",
                 "Prefix cache hit rate:", "Preemptions:"):
        assert part in line


def test_busy_ratio_window_and_buckets():
    m = EngineMetrics("m", 100, log_interval=0, busy_window=1.0)
    from pagedserve.core.outputs import SchedulerStats
    m._window_start = 0.0
    m.record_step(SchedulerStats(), duration=0.5, forward_time=0.25, num_batched_tokens=3)
    m.tick(now=1.0)
    assert m.engine_busy_ratio._value.get() == 0.25
    m.tick(now=2.0)  # an idle window
    assert m.engine_busy_ratio._value.get() == 0.0
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_count_buckets(12) == list(range(1, 13))
    # Neighbouring bounds at most 16% apart above 10 tokens, however long the context.
    ladder = token_count_buckets(131072)
    assert ladder[-1] == 131072 and max(b / a for a, b in zip(ladder[9:], ladder[10:])) <= 1.16


DASHBOARD = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "grafana-dashboard.json"


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_grafana_dashboard_uses_only_exposed_metrics(server):
    used = {m for e in dashboard_exprs() for m in re.findall(r"pagedserve:[a-z0-9_]+", e)}
    exposed = set(scrape(server)) | {k.split("{")[0] for k in scrape(server)}
    assert used and used <= exposed, used - exposed
    for name in ("kv_cache_usage_perc", "num_preemptions_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "engine_busy_ratio"):
        assert "pagedserve:" + name in used


def test_grafana_dashboard_rules():
    """One data-source mechanism, a mean beside every quantile, instances told apart, and the
    committed JSON is what deploy/make_dashboard.py writes (so the rules cannot drift)."""
    sys.path.insert(0, str(DASHBOARD.parent))
    import make_dashboard

    assert DASHBOARD.read_text() == make_dashboard.render()
    dashboard = json.loads(DASHBOARD.read_text())
    assert "__inputs" not in dashboard
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    sources = [p["datasource"] for p in dashboard["panels"] if "datasource" in p]
    sources += [t["datasource"] for p in dashboard["panels"] for t in p.get("targets", [])]
    sources += [v["datasource"] for v in variables.values() if "datasource" in v]
    assert sources and all(ds == {"type": "prometheus", "uid": "${datasource}"} for ds in sources)
    for p in dashboard["panels"]:
        targets = p.get("targets", [])
        for t in targets:
            assert "{{instance}}" in t["legendFormat"], (p["title"], t["legendFormat"])
        histograms = {m for t in targets for m in re.findall(r"pagedserve:([a-z0-9_]+)_bucket", t["expr"])}
        for h in histograms:
            mean = f"rate(pagedserve:{h}_sum"
            assert any(mean in t["expr"] and f"pagedserve:{h}_count" in t["expr"] for t in targets), (p["title"], h)
            assert sum(f"pagedserve:{h}_bucket" in t["expr"] for t in targets) == 3   # P50, P90, P99


def test_vllm_names_carry_the_same_values_with_vllms_bounds():
    """--metric-names both: each metric vLLM has appears also as vllm:* (vLLM's spelling, counters with
    `_total`) holding the very values of its pagedserve:* twin, its histograms on vLLM's bounds
    (metrics.VLLM_BUCKETS, from vLLM's PrometheusStatLogger) so buckets add across a mixed fleet;
    pagedserve's own scrape reader counts the quantity once."""
    from pagedserve.bench.prom import parse_metrics
    from pagedserve.core.outputs import RequestMetrics, SchedulerStats
    from pagedserve.metrics import VLLM_BUCKETS

    m = EngineMetrics("m", 64, log_interval=0, max_num_batched_tokens=32, names="both")
    m.set_cache_config("float32", 16, 8, 256, "cpu")
    m.set_state(running=2, waiting=3, swapped=0, used_blocks=6, total_blocks=8, block_size=16)
    m.record_step(SchedulerStats(num_batched_tokens=7), duration=0.0123, forward_time=0.01, num_batched_tokens=7)
    m.record_first_token(num_prompt_tokens=10, arrival=100.0, first_token=100.25)
    m.record_new_tokens(2, 0.05)
    m.record_finished("length", 10, 2, RequestMetrics(arrival_time=100.0, first_scheduled_time=100.04,
                                                      first_token_time=100.25, last_token_time=101.3,
                                                      finished_time=101.3, num_preemptions=0, num_cached_tokens=0))
    samples = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "le"))
            samples.setdefault(s.name, {})[(labels, s.labels.get("le"))] = s.value
    assert samples["vllm:num_requests_waiting"] == {("", None): 3}
    assert samples["vllm:num_requests_running"] == {("", None): 2}
    assert samples["vllm:kv_cache_usage_perc"] == {("", None): 0.75}
    assert samples["vllm:prompt_tokens_total"] == {("", None): 10}
    assert samples["vllm:generation_tokens_total"] == {("", None): 2}
    assert samples["vllm:request_success_total"][("finished_reason=length", None)] == 1
    assert samples["vllm:time_to_first_token_seconds_sum"] == {("", None): 0.25}
    ttft = {float(le): v for (_, le), v in samples["vllm:time_to_first_token_seconds_bucket"].items()}
    assert sorted(ttft)[:-1] == list(VLLM_BUCKETS.ttft)
    assert all(v == (le >= 0.25) for le, v in ttft.items())
    assert samples["vllm:inter_token_latency_seconds_count"] == {("", None): 2}
    # Every pagedserve:* twin holds the same value; metrics vLLM lacks stay pagedserve:* only.
    for spec in metric_names.METRICS:
        if spec.vllm is not None and spec.kind != "histogram":
            assert samples["vllm:" + spec.exposed] == samples["pagedserve:" + spec.exposed], spec.name
    assert not any(name.startswith("vllm:kv_cache_total_tokens") for name in samples)
    snap = parse_metrics(m.render().decode())
    assert snap.value("prompt_tokens") == 10 and snap.value("num_requests_waiting") == 3
    assert snap.histograms["time_to_first_token_seconds"].count == 1

    only = EngineMetrics("m", 64, log_interval=0, names="vllm")
    names = {f.name for f in text_string_to_metric_families(only.render().decode())}
    assert "vllm:num_requests_waiting" in names and "pagedserve:num_requests_waiting" not in names
    assert "pagedserve:kv_cache_total_tokens" in names  # vLLM has no such metric: kept, under our prefix
    with pytest.raises(ValueError, match="metric_names"):
        EngineMetrics("m", 64, names="VLLM")


def test_serve_metric_names_flag_reaches_the_scrape(tiny_llama):
    """`serve --metric-names vllm`: a request's counts show on a live /metrics under vLLM's names."""
    import argparse

    from pagedserve.server.cli import register, server_settings

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    settings = server_settings(parser.parse_args(["serve", "--metric-names", "vllm"]))
    assert settings["metric_names"] == "vllm"
    assert server_settings(parser.parse_args(["serve"]))["metric_names"] == "pagedserve"
    app, async_engine = build_server(EngineConfig(model=str(tiny_llama), **CONFIG), log_interval=0,
                                     metric_names=settings["metric_names"])
    with ServerThread(app) as st:
        client = openai.OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=async_engine.engine.model_name, prompt="The quick brown fox",
                                      max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        m = scrape(st)
    assert m["vllm:prompt_tokens_total{}"] == r.usage.prompt_tokens
    assert m["vllm:generation_tokens_total{}"] == 3
    assert m["vllm:time_to_first_token_seconds_count{}"] == 1
    assert m["vllm:request_success_total{finished_reason=length}"] == 1
    assert m["vllm:num_requests_waiting{}"] == 0 and m["vllm:num_requests_running{}"] == 0
    assert m["vllm:kv_cache_usage_perc{}"] == 0
    assert m["pagedserve:kv_cache_total_tokens{}"] == 8 * 16
    assert not any(k.startswith("pagedserve:num_requests_waiting") for k in m)


def exposition_samples(text: str) -> list:
    """Every family of a /metrics text as prometheus_client's parser reads it: name, type, help,
    and each sample's name, labels and value (repr: exact, and NaN equals NaN)."""
    return [(f.name, f.type, f.documentation,
             [(s.name, tuple(sorted(s.labels.items())), repr(s.value)) for s in f.samples])
            for f in text_string_to_metric_families(text)]


def traffic_through_every_family(m: EngineMetrics, rng, round_: int) -> None:
    """One round of what the engine and the API loop record, touching every family: steps with
    preemptions, swaps, prefix and tier lookups; requests of each finish reason; the pool, the
    -dp engines (a new rank from round 1 on), KV events, a stall, a grammar error; and values
    generate_latest prints in other forms (counts and bytes >= 1e6, inf, NaN)."""
    from pagedserve.core.outputs import RequestMetrics, SchedulerStats

    m.set_cache_config("bfloat16" if round_ else "float32", 16, 64 + round_, 4096, "cpu")  # relabels the info
    for i in range(30):
        n = rng.randint(1, 256)
        stats = SchedulerStats(num_batched_tokens=n, num_preempted={"recompute": i % 2, "swap": i % 3 == 0},
                               num_recomputed_tokens=i, num_blocks_swapped_out=i % 4, num_blocks_swapped_in=i % 5,
                               prefix_cache_queries=400, prefix_cache_hits=rng.randint(0, 400),
                               prefix_cache_evicted_hits=i % 3, tier_queries=32, tier_hits=i % 7,
                               num_blocks_offloaded=i % 6, num_blocks_loaded=i % 5, tier_used_blocks=i,
                               tier_total_blocks=64)
        m.record_step(stats, duration=rng.expovariate(100), forward_time=0.004, num_batched_tokens=n)
        m.record_first_token(rng.randint(1, 1000), 100.0, 100.0 + rng.expovariate(5))
        m.record_new_tokens(1, None)
        m.record_new_tokens(rng.randint(1, 3), rng.expovariate(50))
        reason = ("stop", "length", "abort", "error")[i % 4]
        metrics = None if reason == "abort" else RequestMetrics(
            arrival_time=100.0, first_scheduled_time=100.0 + rng.expovariate(20), first_token_time=100.3,
            last_token_time=101.0, finished_time=100.5 + rng.expovariate(1), num_preemptions=rng.randint(0, 12),
            num_cached_tokens=0)
        m.record_finished(reason, rng.randint(1, 1000), rng.randint(1, 1000), metrics)
    m.set_state(running=3 + round_, waiting=2, swapped=1, used_blocks=40, total_blocks=64, block_size=16)
    for rank in range(1 + min(round_, 1)):
        m.set_engine_state(rank, running=2, waiting=round_, kv_usage=0.25 * (rank + 1))
    m.set_kv_events(published=100 * (round_ + 1), dropped=round_)
    m.set_stalled(round_ % 2 == 0)
    m.record_structured_output_error()
    m.tick(now=time.monotonic() + 2.0)  # closes the busy-ratio window
    m.prompt_tokens.inc(2.5e6)
    m.kv_cache_bytes_per_token.set(float("nan") if round_ == 1 else float("inf") if round_ == 2 else 4096)
    if round_ == 2:
        m.engine_step.observe(float("inf"))  # +Inf in a _sum
        itl = m.inter_token_latency
        for child in getattr(itl, "children", [itl]):  # each prefix's series (--metric-names both: two)
            child._buckets[3].inc(2e6)  # a count >= 1e6 (Go's exponent form) without 2e6 observe()s


@pytest.mark.parametrize("names", ["pagedserve", "vllm", "both"])
def test_render_has_the_samples_of_generate_latest(names):
    """EngineMetrics.render (metrics_exposition.py, cheap on the API loop) against prometheus_client's
    generate_latest on the same registry, before any traffic and after each of three rounds of
    traffic through every family (the last with counts >= 1e6, inf and NaN values), under each
    --metric-names and a model name that needs escaping: the parsed families, their types, help
    texts, and every sample's name, labels and value are the same, in the same order; so are the bytes."""
    import random

    from prometheus_client import generate_latest

    class Compiler:
        cache_num_entries, cache_num_bytes = 3, 1.5e6

    m = EngineMetrics('tiny "llama"\\v2\n', 1024, log_interval=0, max_num_batched_tokens=256, names=names)
    compiler = Compiler()
    m.watch_grammar_cache(compiler)
    assert exposition_samples(m.render().decode()) == exposition_samples(generate_latest(m.registry).decode())
    rng = random.Random(31)
    for round_ in range(3):
        traffic_through_every_family(m, rng, round_)
        compiler.cache_num_entries += 1
        text, expected = m.render(), generate_latest(m.registry)
        reference = exposition_samples(expected.decode())
        assert exposition_samples(text.decode()) == reference, round_
        assert text == expected, round_  # and byte for byte (values >= 1e6 in Go's exponent form too)
    # Every family held a nonzero value: the comparison covered each one's series.
    empty = [name for name, _, _, samples in reference if not any(float(v) for *_, v in samples)]
    assert not empty
    assert len(reference) == sum(1 + (names == "both" and s.vllm is not None) for s in metric_names.METRICS)


def test_render_falls_back_to_generate_latest_for_a_foreign_collector():
    """A collector the fast path does not know (here a Summary) registered in the metrics' registry:
    render() still gives every sample generate_latest gives, the Summary's among them."""
    from prometheus_client import Summary, generate_latest

    m = EngineMetrics("m", 64, log_interval=0)
    m.render()
    Summary("pagedserve:extra_seconds", "An extra summary.", registry=m.registry).observe(0.5)
    text = m.render().decode()
    assert exposition_samples(text) == exposition_samples(generate_latest(m.registry).decode())
    assert "pagedserve:extra_seconds_sum 0.5" in text


def test_render_writes_created_series_when_something_turns_them_on():
    """enable_created_metrics() (process-wide, by any library) brings back a `_created` series per counter
    and histogram; render() then writes them as generate_latest does."""
    from prometheus_client import disable_created_metrics, enable_created_metrics, generate_latest

    m = EngineMetrics("m", 64, log_interval=0)
    m.render()
    enable_created_metrics()
    try:
        text = m.render().decode()
        assert exposition_samples(text) == exposition_samples(generate_latest(m.registry).decode())
        assert "pagedserve:prompt_tokens_created" in text
    finally:
        disable_created_metrics()
