"""A real server on 127.0.0.1 over a tiny random Llama, driven by the official openai client."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from pagedserve.engine.core_wire import FinishMsg
from pagedserve.config import EngineConfig
from pagedserve.engine import LLM
from pagedserve.sampling import SamplingParams
from pagedserve.server.launcher import ServerThread, build_server
from metrics_scrape import scrape, wait_idle

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys"]


@pytest.fixture(scope="module")
def server(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=512, max_model_len=256, max_num_seqs=32)
    app, async_engine = build_server(config)
    with ServerThread(app) as st:
        st.async_engine = async_engine
        yield st


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), num_kv_blocks=512, max_model_len=256)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(server):
    return server.async_engine.engine.model_name


def test_models_health_version(server, client, model):
    assert [m.id for m in client.models.list().data] == [model]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_greedy_completions_equal_llm_generate(client, model, llm):
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, exp in zip(PROMPTS, expected):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == exp.outputs[0].text
        assert r.choices[0].finish_reason == exp.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert r.usage.completion_tokens == len(exp.outputs[0].token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_several_prompts_in_one_request(client, model, llm):
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    r = client.completions.create(model=model, prompt=PROMPTS, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [e.outputs[0].text for e in expected]
    assert r.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert r.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)


def test_token_id_prompt(client, model, llm):
    ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    r = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    exp = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert r.choices[0].text == exp.outputs[0].text


def test_streaming_completion_with_usage(client, model):
    full = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=20, temperature=0)
    stream = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                                                             "total_tokens"}) == \
        full.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_raw_sse_ends_with_done(server, model):
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": model, "prompt": "abc", "max_tokens": 4, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    for line in lines[:-1]:
        json.loads(line[len("data: "):])


def _chat_expected(llm, messages, max_tokens):
    """The prompt ids come from transformers' own chat templating and tokenizing in one call."""
    ids = llm.get_tokenizer().apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]


def test_chat_greedy_equals_llm_generate_streaming_and_not(client, model, llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write fibonacci."}]
    exp = _chat_expected(llm, messages, 15)
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=15, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == exp.outputs[0].text
    assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
    assert r.usage.completion_tokens == len(exp.outputs[0].token_ids)

    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=15, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == exp.outputs[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_n2_sampled_and_streamed(client, model):
    no_eos = {"ignore_eos": True}  # random weights may sample EOS: the counts below must not depend on it
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=2, seed=7,
                                  extra_body=no_eos)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16
    again = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=2, seed=7,
                                      extra_body=no_eos)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=2,
                                            seed=7, stream=True, stream_options={"include_usage": True},
                                            extra_body=no_eos))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [c.text for c in r.choices]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=5, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same


def _boundary_stop(client, model, max_tokens):
    """(prompt, text, stop, where): a stop string made of the last character of one output token
    and the first of the next, first found exactly there. Tries the fixed prompts in turn; the
    checkpoint is seeded, so the choice is the same every run."""
    for prompt in PROMPTS:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True})
        text = r.choices[0].text
        tokens, offsets = r.choices[0].logprobs.tokens, r.choices[0].logprobs.text_offset
        for i in range(1, len(tokens) - 1):
            clean = all(t and "\ufffd" not in t for t in tokens[i:i + 2])
            if clean and text[offsets[i]:offsets[i + 1]] == tokens[i]:
                stop = tokens[i][-1] + tokens[i + 1][0]
                at = offsets[i + 1] - 1
                if text.find(stop) == at:
                    return prompt, text, stop, at
    raise AssertionError("no clean token boundary in any prompt's output: add a prompt")


def test_stop_string_across_token_boundary(client, model):
    prompt, text, stop, at = _boundary_stop(client, model, 30)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[:at]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    r = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert r.choices[0].text == text[:at + len(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=30, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == text[:at]


def test_logprobs(client, model):
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})  # the counts below must not depend on EOS
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) >= 3 for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.token_logprobs[0] == max(lp.top_logprobs[0].values())  # greedy took the most likely
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_server_logprobs_equal_llm_logprobs(client, model, llm):
    """The server reports the engine's logprobs unchanged (values checked against HF in
    test_logprobs.py): greedy and seeded sampled, completions and chat."""
    tok = llm.get_tokenizer()
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=11)):
        exp = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, logprobs=5, ignore_eos=True, **kw),
                           use_tqdm=False)[0].outputs[0]
        r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, logprobs=5,
                                      extra_body={"ignore_eos": True}, **kw)
        lp = r.choices[0].logprobs
        assert lp.tokens == [tok.decode([t]) for t in exp.token_ids]
        assert lp.token_logprobs == pytest.approx([x.logprob for x in exp.logprobs], abs=1e-6)
        for got, want in zip(lp.top_logprobs, exp.logprobs):
            expected = {tok.decode([want.token_id]): want.logprob}  # OpenAI's dict: first text wins
            for tid, v in want.top:
                expected.setdefault(tok.decode([tid]), v)
            assert got == pytest.approx(expected, abs=1e-6)
    messages = [{"role": "user", "content": "x"}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    exp = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in exp.logprobs], abs=1e-6)
    for c, x in zip(content, exp.logprobs):
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([v for _, v in x.top], abs=1e-6)
    assert [[t.token for t in c.top_logprobs] for c in content] == \
        [[tok.decode([tid]) for tid, _ in x.top] for x in exp.logprobs]


def test_tokenize_detokenize(server, llm):
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert r["tokens"] == llm.get_tokenizer()(PROMPTS[0]).input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == PROMPTS[0]
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 0


def test_twenty_streaming_clients_disconnect_mid_stream(server, model):
    before = scrape(server)

    async def one(i: int) -> int:
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", server.url + "/v1/completions",
                                json={"model": model, "prompt": f"{i} {PROMPTS[i % 3]}", "max_tokens": 230,
                                      "ignore_eos": True, "temperature": 0, "stream": True}) as r:
                got = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        got += 1
                        if got == 2:
                            break  # leave mid-stream: the connection closes
                return got

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(20)))

    assert asyncio.run(all_of_them()) == [2] * 20
    after = wait_idle(server)
    assert after["pagedserve:num_requests_running{}"] == 0
    assert after["pagedserve:kv_cache_used_tokens{}"] == 0
    assert after["pagedserve:kv_cache_usage_perc{}"] == 0
    aborted = (after["pagedserve:request_success_total{finished_reason=abort}"]
               - before["pagedserve:request_success_total{finished_reason=abort}"])
    assert aborted == 20
    engine = server.async_engine.engine
    assert engine.kv_cache_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_non_streaming_client_that_leaves_is_aborted(server, model):
    """The engine is held while the client gives up, so the abort is certain, not a race."""
    ae = server.async_engine
    before = scrape(server)
    ae.pause()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(30, read=0.5),
                       json={"model": model, "prompt": "hello", "max_tokens": 100, "ignore_eos": True})
        # the abort reaches the command queue once the server sees the disconnect
        end = time.monotonic() + 30
        while not any(isinstance(c, FinishMsg) and c.status.name == "FINISHED_ABORTED" for c in ae.client.inbox.pending()):
            assert time.monotonic() < end, "the server never queued an abort for the client that left"
            time.sleep(0.02)
    finally:
        ae.resume()
    after = wait_idle(server)
    assert after["pagedserve:request_success_total{finished_reason=abort}"] == \
        before["pagedserve:request_success_total{finished_reason=abort}"] + 1
    assert not ae.engine.has_unfinished_requests()


def test_cli_flags_and_yaml(tmp_path, tiny_llama):
    from pagedserve.cli import build_parser
    from pagedserve.engine_args import engine_config_from_args
    from pagedserve.server.cli import server_settings

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 9100\nmax-queue-len: 7\nmax_num_seqs: 3\nhost: 127.0.0.1\n")
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama), "--config", str(cfg),
                                      "--api-key", "k", "--max-num-seqs", "5", "--served-model-name", "tiny"])
    settings = server_settings(args)
    assert settings == {"host": "127.0.0.1", "port": 9100, "api_key": "k", "max_queue_len": 7,
                        "max_seqs_per_request": None, "step_watchdog_timeout": None,
                        "max_request_bytes": None, "enable_prompt_tokens_details": False,
                        "enable_auto_tool_choice": False, "tool_call_parser": None,
                        "dashboard": True, "shutdown_timeout": None, "header_read_timeout": None,
                        "body_read_timeout": None, "metric_names": "pagedserve", "replicas": None,
                        "router": "kv-aware", "autoscale": None}
    config = engine_config_from_args(args)
    assert config.max_num_seqs == 5 and config.served_model_name == "tiny"
    args = build_parser().parse_args(["serve"])
    assert server_settings(args)["port"] == 8000 and server_settings(args)["host"] == "127.0.0.1"
    assert engine_config_from_args(args).model is None  # the built-in default model


def test_pagedserve_serve_subprocess(tiny_llama):
    """`pagedserve serve` end to end, as an operator starts it. It binds port 0 itself and the
    test reads the port uvicorn chose from its start-up line (no pick-close-reuse race)."""
    import queue
    import re
    import subprocess
    import sys
    import threading

    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(tiny_llama),
                             "--port", "0", "--num-kv-blocks", "32", "--max-model-len", "64",
                             "--served-model-name", "tiny", "--uvicorn-log-level", "info"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        seen, port = [], None
        end = time.monotonic() + 120
        while port is None:
            assert time.monotonic() < end, "no 'Uvicorn running on' line:\n" + "".join(seen)
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "".join(seen)
                continue
            seen.append(line)
            match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            port = int(match.group(1)) if match else None
        url = f"http://127.0.0.1:{port}"
        assert port > 0 and httpx.get(url + "/health", timeout=30).status_code == 200
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        r = c.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    finally:
        proc.terminate()
        proc.wait(30)


def test_every_server_setting_is_accepted_in_a_serve_yaml_by_both_readers(tmp_path, tiny_llama):
    """A serve YAML is read twice: the engine's knobs by engine_config_from_args (which refuses a
    key it does not know) and the server's own by server_settings. Every server setting must get
    past the first and be taken by the second: one list of the keys, not two that drift apart."""
    from pagedserve.cli import build_parser
    from pagedserve.engine_args import SERVER_KEYS, engine_config_from_args
    from pagedserve.server.cli import _SERVER_DEFAULTS, server_settings

    assert SERVER_KEYS == set(_SERVER_DEFAULTS)
    values = {"host": "127.0.0.1", "port": 9101, "api_key": "k", "max_queue_len": 9, "max_request_bytes": 4096,
              "max_seqs_per_request": 3, "step_watchdog_timeout": 7, "enable_prompt_tokens_details": True,
              "enable_auto_tool_choice": True, "tool_call_parser": "hermes", "dashboard": False,
              "shutdown_timeout": 2, "header_read_timeout": 4, "body_read_timeout": 5,
              "metric_names": "both", "replicas": 2, "router": "round-robin", "autoscale": "1:4"}
    assert set(values) == SERVER_KEYS
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items()) + "max_num_seqs: 3\n")
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama), "--config", str(cfg)])
    assert engine_config_from_args(args).max_num_seqs == 3
    assert server_settings(args) == values


@pytest.mark.parametrize("key", ["port", "max_queue_len", "max_request_bytes", "max_seqs_per_request"])
def test_a_yaml_boolean_is_not_a_count(tmp_path, key):
    """YAML reads `max_queue_len: true` as a bool, which Python counts as the integer 1: a limit of
    one the operator never wrote. It is refused by name instead."""
    from pagedserve.cli import build_parser
    from pagedserve.server.cli import server_settings

    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"{key}: true\n")
    with pytest.raises(ValueError, match=key):
        server_settings(build_parser().parse_args(["serve", "--config", str(cfg)]))
