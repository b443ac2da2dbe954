"""`serve --replicas`: two replicas of a tiny model on a local Ray instance this module starts.

Greedy text through the fleet equals HF transformers'; SSE streams and aborts pass through; the
kv-aware router sends a repeated prompt to the replica holding it (its KV events) and /metrics
shows every replica under a `replica` label beside the router's counts; a replica killed under
load costs only its in-flight streams, nothing hangs, Ray restarts it and the router forgets the
dead one.

One module-scoped fleet serves every check (the kill last, since it costs a replica). Cheap to
start, so it runs in the default suite: Ray with 4 CPUs (one per replica, two for the tp=2
replica of the one check that starts a second application; Ray prestarts that many workers,
which the replicas then take), a small object store, no dashboard, and no job
runtime_env (a local Ray's workers inherit this process's environment; a runtime_env would make
Ray start fresh workers for it instead of using the prestarted ones); torn down by ray.shutdown
alone (serve.shutdown waits out each replica's graceful drain first)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time

import httpx
import pytest

PROMPT_IDS = [(7 * i + 3) % 200 + 5 for i in range(41)]      # 10 full blocks of 4 + 1 token
CONFIG = dict(num_kv_blocks=64, block_size=4, max_model_len=128, max_num_seqs=4, enable_prefix_caching=True)
# Ray's logical CPUs: one per replica of the shared fleet, two for the tp=2 replica's ranks.
NUM_CPUS = 4


@pytest.fixture(scope="module")
def fleet(tiny_llama):
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.serve")

    from pagedserve.config import EngineConfig
    from pagedserve.fleet.serve import free_port, run_fleet

    # The replicas inherit the environment the raylet starts with: one thread each.
    omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        ray.init(address="local", num_cpus=NUM_CPUS, object_store_memory=80 * 2**20, include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=False)   # loopback only
    finally:
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    try:
        port = free_port()
        run_fleet(EngineConfig(model=str(tiny_llama), **CONFIG), 2, "kv-aware", "127.0.0.1", port, blocking=False)
        url = f"http://127.0.0.1:{port}"
        model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
        yield url, model
    finally:
        ray.shutdown()   # takes Serve's actors with it


def metric_samples(url: str) -> list[tuple[str, dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=60).text
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def per_replica(samples, name: str, **labels) -> dict[str, float]:
    return {lab["replica"]: v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())}


def wait_for(predicate, what: str, deadline_s: float = 240.0):
    """Poll until `predicate()` is truthy (a bound that turns a hang into a failure, not a timing assert)."""
    end = time.monotonic() + deadline_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < end, f"{what}: not within {deadline_s} s"
        time.sleep(0.5)


def completion(url, model, prompt, max_tokens, stream=False, timeout=120.0, started=None):
    """(status, body) or, streamed, (status, the SSE data lines); `started` (an Event) is set at the
    first data line, or when the request ends without one."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        return r.status_code, r.json()
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if started is not None:
                        started.set()
    finally:
        if started is not None:
            started.set()
    return r.status_code, events


def test_greedy_text_streams_and_routing_by_kv_events(fleet, tiny_llama):
    from transformers import AutoTokenizer

    from checkpoints import hf_greedy

    url, model = fleet
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    expected = tokenizer.decode(hf_greedy(tiny_llama, [PROMPT_IDS], [6])[0])
    status, body = completion(url, model, PROMPT_IDS, 6)
    assert status == 200 and body["choices"][0]["text"] == expected
    status, events = completion(url, model, PROMPT_IDS, 6, stream=True)
    assert status == 200 and events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected
    # The streamed request found the prompt's 10 blocks where the first left them.
    # (Each replica's exposition reaches /metrics with Ray's routing stats, about once a second.)
    samples = wait_for(lambda: (s := metric_samples(url)) and sum(
        per_replica(s, "pagedserve:router_requests_total", decision="prefix").values()) >= 1
        and sum(per_replica(s, "pagedserve:request_success_total", finished_reason="length").values()) == 2 and s,
        "a prefix decision and both requests on /metrics")
    hits = per_replica(samples, "pagedserve:prefix_cache_hits_total")
    assert max(hits.values()) == 40, hits   # the repeat was served all 40 cached tokens
    matched = [v for n, lab, v in samples if n == "pagedserve:router_matched_tokens_total"]
    assert matched and matched[0] >= 40
    # Load both replicas at once: /metrics shows each under its own label.
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: completion(url, model, [i + 1] * (6 + i), 4), range(6)))
    assert all(status == 200 for status, _ in results)
    samples = wait_for(lambda: (s := metric_samples(url)) and sum(per_replica(
        s, "pagedserve:request_success_total", finished_reason="length").values()) == 2 + 6 and s,
        "all eight requests on /metrics", 60)
    replicas = per_replica(samples, "pagedserve:request_success_total", finished_reason="length")
    assert len(replicas) == 2, replicas
    assert [v for n, lab, v in samples if n == "pagedserve:router_replicas"] == [2]


def test_a_client_that_disconnects_aborts_on_its_replica(fleet):
    url, model = fleet
    before = sum(per_replica(metric_samples(url), "pagedserve:request_success_total",
                             finished_reason="abort").values())
    body = {"model": model, "prompt": [3] * 9, "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break   # one token seen; closing the stream is the disconnect
    # Counted once, and its blocks back: nothing running, no token slot held, on any replica.
    wait_for(lambda: (s := metric_samples(url)) and sum(per_replica(
        s, "pagedserve:request_success_total", finished_reason="abort").values()) == before + 1
        and sum(per_replica(s, "pagedserve:num_requests_running").values()) == 0
        and sum(per_replica(s, "pagedserve:kv_cache_used_tokens").values()) == 0, "the abort reaching the engine", 120)


def test_a_tensor_parallel_replica_matches_hf(fleet, tiny_llama):
    """A replica that is a -tp 2 engine: its two ranks (mp, the replica's child processes) are
    placed with it (Ray reserves both ranks' CPUs), and its greedy text through the fleet's
    endpoint equals HF transformers' and the tp=1 fleet's. A second application on the same Ray
    and Serve, torn down after."""
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from checkpoints import hf_greedy
    from pagedserve.config import EngineConfig
    from pagedserve.fleet.serve import build_fleet

    url, model = fleet
    app = build_fleet(EngineConfig(model=str(tiny_llama), tensor_parallel_size=2, **CONFIG), 1, "round-robin")
    cpus_free = ray.available_resources().get("CPU", 0.0)
    serve.run(app, name="pagedserve-tp2", route_prefix="/tp2", blocking=False)
    try:
        wait_for(lambda: httpx.get(url + "/tp2/v1/models", timeout=30).status_code == 200, "the tp=2 replica")
        # (Ray's resource view lags the placement by a heartbeat or two.)
        wait_for(lambda: ray.available_resources().get("CPU", 0.0) == cpus_free - 2, "both ranks' CPUs reserved", 30)
        expected = AutoTokenizer.from_pretrained(tiny_llama).decode(hf_greedy(tiny_llama, [PROMPT_IDS], [6])[0])
        status, body = completion(url + "/tp2", model, PROMPT_IDS, 6)
        assert status == 200 and body["choices"][0]["text"] == expected
        status, events = completion(url + "/tp2", model, PROMPT_IDS, 6, stream=True)
        assert status == 200 and events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected
        assert completion(url, model, PROMPT_IDS, 6)[1]["choices"][0]["text"] == expected   # the tp=1 fleet's
    finally:
        serve.delete("pagedserve-tp2")


def test_a_killed_replica_costs_only_its_in_flight_requests(fleet):
    import ray

    url, model = fleet
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if "EngineReplica" in a["name"]]
    assert len(names) == 2
    started = [threading.Event() for _ in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # 100 tokens each (prompt 9 + 100 < max_model_len 128): still running at the kill.
        futures = [pool.submit(completion, url, model, [i + 2] * 9, 100, True, 300.0, started[i]) for i in range(8)]
        for event in started:           # every stream has its first token: the kill lands under load
            assert event.wait(240), "a stream did not start"
        # The victim is a replica the router has streams on now (a burst can land on one replica
        # before the queue-length probes catch up: killing the other would cost nothing).
        in_flight = per_replica(metric_samples(url), "pagedserve:router_in_flight")
        victim_id = max(in_flight, key=in_flight.get)
        assert in_flight[victim_id] >= 1, in_flight
        victim_name = next(n for n in names if n.rsplit("#", 1)[1] == victim_id)
        victim = ray.get_actor(victim_name, namespace="serve")
        ray.kill(victim, no_restart=True)
        results = [f.result(timeout=300) for f in futures]   # nothing hangs
    finished = errored = 0
    for status, events in results:
        if status != 200:
            errored += 1          # not started: retried once, else a clean 503
            continue
        if events and events[-1] == "[DONE]":
            assert sum(len(json.loads(e)["choices"][0]["text"]) >= 0 for e in events[:-1]) >= 1
            finished += 1
        else:
            assert events and "error" in json.loads(events[-1]), events[-3:]
            errored += 1
    # The survivor's streams finish; the victim's (mid-stream, so not retried) end in an error event.
    assert finished + errored == 8 and finished >= 1 and errored >= 1, (finished, errored)
    # Ray starts a new replica; the router forgets the dead one and routes to both again.
    samples = wait_for(lambda: (s := metric_samples(url)) and [v for n, _, v in s if n == "pagedserve:router_replicas"]
                       == [2] and victim_id not in per_replica(s, "pagedserve:num_requests_running") and len(
        per_replica(s, "pagedserve:num_requests_running")) == 2 and s, "a restarted replica", 300)
    assert [v for n, _, v in samples if n == "pagedserve:router_replicas_forgotten_total"][0] >= 1
    assert victim_id not in per_replica(samples, "pagedserve:router_cached_blocks")
    status, body = completion(url, model, PROMPT_IDS, 3)
    assert status == 200 and body["usage"]["completion_tokens"] == 3
