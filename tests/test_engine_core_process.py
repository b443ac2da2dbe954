"""The engine core in its own process (--engine-core-mode process): the API process keeps
tokenization, detokenization, stop strings and metrics, and sends only plain data.

- every message type survives the msgspec wire unchanged (requests with their sampling
  parameters, finishes with their status, outputs with logprobs and stats);
- a split server gives the same greedy text as the in-process engine (LLM.generate);
- a stop string found in the API process ends the request in the core (its blocks return),
  an abort on client disconnect too, and a bad request changes nothing.
"""
from __future__ import annotations


import httpx
import pytest

from metrics_scrape import scrape, wait_idle
from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.core.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats, TokenLogprobs
from pagedserve.core.request import EngineCoreRequest, FinishReason, Request, RequestStatus
from pagedserve.engine.core_wire import (ENCODER, FROM_CORE_DECODER, TO_CORE_DECODER, AddMsg, DeadMsg, FinishMsg,
                                           OutputsMsg, ShutdownMsg)
from pagedserve.server.launcher import ServerThread, build_server

ENGINE = dict(num_kv_blocks=64, max_model_len=256, max_num_seqs=8)
PROMPTS = ["def fibonacci(n):", "import os", "The quick brown fox", "class Scheduler:"]


def test_every_message_survives_the_wire():
    params = SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=5, seed=123, stop=["\n\n"], stop_token_ids=[3],
                            max_tokens=9, min_tokens=2, logprobs=2, ignore_eos=True)
    req = Request("r1", [5, 6, 7], params, frozenset({2, 9}), arrival_time=12.5, priority=-1, max_model_len=256)
    data = EngineCoreRequest.of(req)
    for msg in (AddMsg([data]), FinishMsg(["r1", "0:r2"], RequestStatus.FINISHED_STOPPED, "\n\n"),
                FinishMsg(["r3"], RequestStatus.FINISHED_ABORTED), ShutdownMsg()):
        assert TO_CORE_DECODER.decode(ENCODER.encode(msg)) == msg
    back = TO_CORE_DECODER.decode(ENCODER.encode(AddMsg([data]))).requests[0].to_request()
    assert (back.request_id, back.prompt_token_ids, back.sampling_params, back.eos_token_ids, back.times.arrival,
            back.priority, back.max_model_len) == ("r1", [5, 6, 7], params, frozenset({2, 9}), 12.5, -1, 256)
    outs = EngineCoreOutputs([EngineCoreOutput("r1", [11], [TokenLogprobs(11, -0.25, 1, [(11, -0.25), (4, -1.5)])],
                                               FinishReason.LENGTH, None, 2, 10.0, 16),
                              EngineCoreOutput("r2", [12], None, FinishReason.STOP, "\n\n")],
                             SchedulerStats(num_batched_tokens=2, num_preempted={"swap": 1}, kv_usage=0.5),
                             11.0, 0.01, 0.009, 0.008)
    for msg in (OutputsMsg(outs, 3), DeadMsg("WorkerDied: rank 1 died", False)):
        assert FROM_CORE_DECODER.decode(ENCODER.encode(msg)) == msg


@pytest.fixture(scope="module")
def split_server(tiny_llama):
    app, async_engine = build_server(EngineConfig(model=str(tiny_llama), **ENGINE), engine_core_mode="process")
    with ServerThread(app) as server:
        server.async_engine = async_engine
        yield server


def completion(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"temperature": 0, **body}, timeout=60)


def test_split_server_matches_the_in_process_engine(split_server, tiny_llama):
    with LLM(str(tiny_llama), **ENGINE) as llm:
        want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0,
                                                                                 ignore_eos=True), use_tqdm=False)]
    got = [completion(split_server, prompt=p, max_tokens=12, ignore_eos=True).json()["choices"][0]["text"]
           for p in PROMPTS]
    assert got == want
    stream = httpx.post(split_server.url + "/v1/completions", timeout=60,
                        json={"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                              "stream": True})
    import json
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in stream.text.splitlines()
                   if line.startswith("data: {"))
    assert text == want[0]


def test_stop_string_found_in_the_api_process_ends_the_core_request(split_server):
    """The stop string is matched in the API process; the core must stop computing at once
    (it would otherwise run on to max_tokens), and its blocks return."""
    full = completion(split_server, prompt="def fibonacci(n):", max_tokens=40, ignore_eos=True).json()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert len(stop) == 2 and text.index(stop) < len(text) - 2
    computed = "pagedserve:iteration_tokens_total_sum{}"
    before = wait_idle(split_server)[computed]
    # max_tokens near the context (256): a core that never heard of the stop would compute all of them.
    cut = completion(split_server, prompt="def fibonacci(n):", max_tokens=240, ignore_eos=True, stop=[stop]).json()
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[:text.index(stop)]
    m = wait_idle(split_server)
    assert m["pagedserve:kv_cache_used_tokens{}"] == 0 and m["pagedserve:num_requests_running{}"] == 0
    # The core runs on while the API process detokenizes, finds the stop and sends the abort back: 28-37
    # tokens after the prompt here alone (stop ~15 tokens in), 60+ in one full-suite run once a tiny model's
    # step took a fraction of a millisecond (the native forward). Far from max_tokens is what "stopped" means.
    ran = m[computed] - before - cut["usage"]["prompt_tokens"]
    assert ran < 160, f"the core ran on past the stop string: {ran} of max_tokens 240 computed"


def test_disconnect_aborts_in_the_core_and_bad_input_changes_nothing(split_server):
    aborted = "pagedserve:request_success_total{finished_reason=abort}"
    before = scrape(split_server)[aborted]
    body = {"prompt": "hello", "max_tokens": 250, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", split_server.url + "/v1/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))  # one token, then hang up
    m = wait_idle(split_server)
    assert m["pagedserve:kv_cache_used_tokens{}"] == 0 and m["pagedserve:num_requests_running{}"] == 0
    assert m[aborted] == before + 1
    r = completion(split_server, prompt=[1] * 300, max_tokens=4)
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    assert httpx.get(split_server.url + "/health").status_code == 200
    assert split_server.async_engine.client.process.is_alive()


def test_auto_runs_the_engine_core_in_its_own_process_on_cpu_and_cuda():
    """`pagedserve serve`'s default: process on both devices (docs/scaling.md has the CPU
    measurement); an explicit mode is kept, anything else refused by name."""
    from pagedserve.server.launcher import resolve_engine_core_mode

    assert resolve_engine_core_mode("auto", "cpu") == "process"
    assert resolve_engine_core_mode("auto", "cuda") == "process"
    assert resolve_engine_core_mode("thread", "cpu") == "thread"
    with pytest.raises(ValueError, match="engine_core_mode"):
        resolve_engine_core_mode("threads", "cpu")
