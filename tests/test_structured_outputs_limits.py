"""Structured outputs at the grammar engine's limits, judged independently of the engine:

- a choice list of 5,000 strings (past llguidance's 2,000-items-per-row Earley limit) still
  constrains: at temperature 1.0 every output is one of the strings;
- a user grammar whose first row is over the limit is a 400 naming its field (found at
  compile time); one that trips the limit mid-generation ends that request with an error
  (offline: finish_reason "error"; non-streaming: a 400 naming the field; streaming: an SSE
  error event, then [DONE]), counted in /metrics, with its blocks returned: never a 200
  carrying unconstrained text;
- a JSON schema that does not say `additionalProperties` gets no invented keys (parsed, keys
  checked against `properties`), unless the caller opts out (vLLM's
  `disable_additional_properties: false`) or the schema itself allows extra keys;
- the compiled-grammar cache is bounded by estimated bytes as well as entries (LRU), and
  /metrics shows its size.
"""
from __future__ import annotations

import itertools
import json
import re
import string

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.structured import StructuredOutputsParams
from pagedserve.structured.compiler import GrammarCompiler

WORDS = ["".join(w) for w in itertools.islice(itertools.product(string.ascii_lowercase, repeat=4), 4989)]
# Strings a grammar literal must escape, among the 5,000.
SPECIALS = ['say "hi"', "back\\slash", "new\nline", "tab\there", "ünï ✓ 日本", "a.b*c+(d)?[e]{2}^$|",
            "/slash/", "C:\\path", "yes", "yesterday", "emoji 😀 ok"]
CHOICES = WORDS + SPECIALS
assert len(set(CHOICES)) == 5000


def big_alternation(n: int = 2500) -> str:
    return " | ".join(json.dumps(w) for w in WORDS[:n])


# Fails at its first token: the start row holds 2,500 items.
GRAMMAR_OVER_LIMIT_AT_START = "start: " + big_alternation()
GBNF_OVER_LIMIT_AT_START = "root ::= " + big_alternation()
# Fails mid-generation: eight free letters (never forced, so nothing looks ahead into the
# rule), then ":" and a 2,500-item rule whose row is built only when the word is complete.
GRAMMAR_FAILING_AFTER_A_WORD = 'start: WORD ":" pick\nWORD: /[a-z]{8}/\npick: ' + big_alternation()

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=64, max_model_len=256, max_num_seqs=32)


def _idle(engine) -> bool:
    return engine.block_pool.num_free_blocks == engine.block_pool.num_blocks and not engine.scheduler.requests


def test_choice_of_5000_strings_at_temperature_one_stays_in_the_list(llm):
    spec = StructuredOutputsParams(choice=CHOICES)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=16, structured_outputs=spec) for i in range(24)]
    outs = llm.generate(["Pick one:"] * 24, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(t in CHOICES for t in texts), [t for t in texts if t not in CHOICES]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert len(set(texts)) > 1  # it really samples


def test_each_special_choice_is_reachable_and_exact(llm):
    """Escaping: a grammar of only the special strings, each forced by a one-item list."""
    for s in SPECIALS:
        out = llm.generate("x", SamplingParams(temperature=1.0, seed=1, max_tokens=32,
                                               structured_outputs=StructuredOutputsParams(choice=[s])),
                           use_tqdm=False)[0].outputs[0]
        assert out.text == s and out.finish_reason == "stop"


def test_grammar_over_the_row_limit_at_its_first_token_is_refused_before_queueing(llm):
    for grammar in (GRAMMAR_OVER_LIMIT_AT_START, GBNF_OVER_LIMIT_AT_START):
        with pytest.raises(ValueError, match=r"^guided_grammar: .*too complex.*max is 2000"):
            llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(
                grammar=grammar, field="guided_grammar")), use_tqdm=False)
    assert _idle(llm.engine)


def test_grammar_failing_mid_generation_ends_with_error_offline(llm):
    spec = StructuredOutputsParams(grammar=GRAMMAR_FAILING_AFTER_A_WORD)
    outs = llm.generate(["a:", "b:"], SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec),
                        use_tqdm=False)
    for out in outs:
        comp = out.outputs[0]
        assert comp.finish_reason == "error"
        # What was kept is the valid prefix the grammar took: the eight letters, nothing after.
        assert re.fullmatch(r"[a-z]{1,8}", comp.text), comp.text
        assert len(comp.token_ids) >= 1  # it failed mid-generation, not at the start
    assert _idle(llm.engine)
    # The engine goes on serving, constrained.
    ok = llm.generate("x", SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(
        regex=r"[0-9]{3}")), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"[0-9]{3}", ok.text)


def _accepts(compiler, spec, text: str) -> bool:
    """Whether the compiled grammar takes `text` (the tokenizer's tokens, fed one by one)."""
    matcher = compiler.new_matcher(spec)
    for token in compiler.tokenizer(text, add_special_tokens=False).input_ids:
        matcher.accept(token)
        if matcher.is_error:
            return False
    return True


def test_json_schema_without_additional_properties_gets_no_invented_keys(llm):
    spec = StructuredOutputsParams(json=PERSON)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=spec) for i in range(30)]
    outs = llm.generate(["A person as JSON:"] * 30, params, use_tqdm=False)
    for out in outs:
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", comp.text
        obj = json.loads(comp.text)
        assert set(obj) <= set(PERSON["properties"]), comp.text


def test_closed_objects_and_the_opt_outs(llm):
    compiler = llm.engine.grammar_compiler
    extra = '{"name": "o", "zzz": 1}'
    listed = '{"name": "o", "age": 5}'
    closed = StructuredOutputsParams(json=PERSON)
    opened = StructuredOutputsParams(json=PERSON, disable_additional_properties=False)
    assert _accepts(compiler, closed, listed) and not _accepts(compiler, closed, extra)
    assert _accepts(compiler, opened, extra)  # the request-level opt-out (vLLM's field)
    # A schema that says additionalProperties itself is followed either way.
    allows = StructuredOutputsParams(json={**PERSON, "additionalProperties": True})
    assert _accepts(compiler, allows, extra)
    # Nested objects close too; "any object" (json_object, or no properties) stays open.
    nested = {"type": "object", "properties": {"p": PERSON}, "required": ["p"]}
    assert not _accepts(compiler, StructuredOutputsParams(json=nested), '{"p": {"name": "o", "zzz": 1}}')
    assert _accepts(compiler, StructuredOutputsParams(json_object=True), '{"zzz": 1}')
    assert _accepts(compiler, StructuredOutputsParams(json={"type": "object"}), '{"zzz": 1}')
    # allOf members are left open: closing each would reject the keys the other adds.
    both = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                      {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert _accepts(compiler, StructuredOutputsParams(json=both), '{"a": 1, "b": 2}')
    # The two settings are distinct cache entries.
    assert compiler.compile(closed) is not compiler.compile(opened)


def test_cache_is_bounded_by_bytes_lru(llm):
    from pagedserve.structured.compiler import ENTRY_BASE_BYTES

    base = llm.engine.grammar_compiler
    specs = [StructuredOutputsParams(regex=f"[a-z]{{{i}}}") for i in range(1, 6)]
    sizes = [GrammarCompiler(base.tokenizer, base.vocab_size, frozenset(base.eos_token_ids)).compile(s)
             .estimated_bytes for s in specs]
    assert all(s >= ENTRY_BASE_BYTES for s in sizes)
    bound = sizes[0] + sizes[1] + sizes[2] + 1  # room for three
    c = GrammarCompiler(base.tokenizer, base.vocab_size, frozenset(base.eos_token_ids), cache_bytes=bound)
    for s in specs[:3]:
        c.compile(s)
    assert c.cache_num_entries == 3 and c.cache_num_bytes == sum(sizes[:3])
    c.compile(specs[0])  # a hit: now the most recently used
    c.compile(specs[3])  # over the bound: the least recently used (specs[1]) goes
    assert c.cache_num_entries == 3 and c.cache_num_bytes <= bound
    n = c.num_compiled
    c.compile(specs[0])
    assert c.num_compiled == n  # kept
    c.compile(specs[1])
    assert c.num_compiled == n + 1  # evicted, compiled again
    # A grammar estimated over the whole bound is used but not kept.
    tiny = GrammarCompiler(base.tokenizer, base.vocab_size, frozenset(base.eos_token_ids), cache_bytes=1000)
    assert tiny.compile(specs[0]).new_matcher() is not None
    assert tiny.cache_num_entries == 0 and tiny.cache_num_bytes == 0


def test_cache_byte_bound_is_an_engine_knob():
    from pagedserve.config import EngineConfig

    assert EngineConfig(structured_outputs_cache_bytes="1MiB").structured_outputs_cache_bytes == 1 << 20
    with pytest.raises(ValueError, match="^structured_outputs_cache_bytes:"):
        EngineConfig(structured_outputs_cache_bytes="lots")
    from checkpoints import config_from_flags

    assert config_from_flags(["--structured-outputs-cache-bytes", "8MiB"]).structured_outputs_cache_bytes == 8 << 20
    llm = LLM(num_kv_blocks=8, max_model_len=64, structured_outputs_cache_bytes="2MiB")
    assert llm.engine.grammar_compiler.cache_bytes == 2 << 20


# -- over HTTP ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    from pagedserve.config import EngineConfig
    from pagedserve.server.launcher import ServerThread, build_server
    app, async_engine = build_server(EngineConfig(num_kv_blocks=64, max_model_len=256,
                                                  structured_outputs_cache_bytes="32MiB"), log_interval=0)
    with ServerThread(app) as srv:
        srv.async_engine = async_engine
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            srv.client = c
            yield srv


def _metrics(srv) -> dict[str, float]:
    from metrics_scrape import scrape
    return scrape(srv)


@pytest.mark.parametrize("body", [{"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}])
def test_choice_of_5000_over_http(server, body):
    r = server.client.post("/v1/completions", json={"prompt": "Pick:", "temperature": 1.0, "n": 4, "seed": 3,
                                                    "max_tokens": 16, **body})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert all(t in CHOICES for t in texts), texts


@pytest.mark.parametrize("body,param", [
    ({"guided_grammar": GRAMMAR_OVER_LIMIT_AT_START}, "guided_grammar"),
    ({"guided_grammar": GBNF_OVER_LIMIT_AT_START}, "guided_grammar"),
    ({"structured_outputs": {"grammar": GRAMMAR_OVER_LIMIT_AT_START}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "disable_additional_properties": False}},
     "structured_outputs.disable_additional_properties"),
])
def test_grammar_over_the_limit_is_a_400_naming_the_field(server, body, param):
    r = server.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_matcher_failure_mid_generation_is_an_error_the_client_sees(server):
    before = _metrics(server)
    body = {"prompt": "word:", "max_tokens": 40, "temperature": 0, "guided_grammar": GRAMMAR_FAILING_AFTER_A_WORD}
    r = server.client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_grammar"
    assert re.search(r"failed after [1-9]\d* generated tokens.*max is 2000", err["message"]), err["message"]
    chat = server.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a word"}], "max_tokens": 40, "temperature": 0,
        "structured_outputs": {"grammar": GRAMMAR_FAILING_AFTER_A_WORD}})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "structured_outputs", chat.text

    events = []
    with server.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert "error" in payloads[-1] and payloads[-1]["error"]["param"] == "guided_grammar", payloads[-1]
    streamed = "".join(c["text"] for p in payloads[:-1] for c in p.get("choices", []))
    assert re.fullmatch(r"[a-z]{1,8}", streamed), streamed  # what came before is the grammar's prefix only
    assert all("error" not in p for p in payloads[:-1])

    from metrics_scrape import wait_idle
    after = wait_idle(server)
    assert after["pagedserve:structured_output_errors_total{}"] - before["pagedserve:structured_output_errors_total{}"] == 3
    key = "pagedserve:request_success_total{finished_reason=error}"
    assert after[key] - before[key] == 3
    core = server.async_engine.engine_core
    assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.pool.num_blocks
    ok = server.client.post("/v1/completions", json={"prompt": "id:", "guided_regex": "[0-9]{3}", "max_tokens": 8})
    assert ok.status_code == 200 and re.fullmatch(r"[0-9]{3}", ok.json()["choices"][0]["text"])


def test_additional_properties_opt_out_over_http(server):
    schema_body = {"prompt": "A person:", "temperature": 1.0, "max_tokens": 60, "n": 4, "seed": 7}
    closed = server.client.post("/v1/completions", json={**schema_body, "structured_outputs": {"json": PERSON}})
    assert closed.status_code == 200, closed.text
    for c in closed.json()["choices"]:
        if c["finish_reason"] == "stop":
            assert set(json.loads(c["text"])) <= set(PERSON["properties"]), c["text"]
    opened = server.client.post("/v1/completions", json={**schema_body, "structured_outputs": {
        "json": PERSON, "disable_additional_properties": False}})
    assert opened.status_code == 200, opened.text


def test_grammar_cache_size_on_metrics(server):
    from pagedserve.structured.compiler import ENTRY_BASE_BYTES

    compiler = server.async_engine.engine.grammar_compiler
    assert compiler.cache_bytes == 32 << 20
    server.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "guided_regex": "[a-c]{4}"})
    m = _metrics(server)
    assert m["pagedserve:grammar_cache_entries{}"] == compiler.cache_num_entries >= 1
    assert m["pagedserve:grammar_cache_bytes{}"] == compiler.cache_num_bytes >= ENTRY_BASE_BYTES


def test_matcher_failure_crosses_from_an_engine_core_process():
    """The failure is found in the engine-core process and travels over its wire (StepResult
    errors -> EngineCoreOutput.error) to the API process, which answers with the error."""
    from pagedserve.config import EngineConfig
    from pagedserve.server.launcher import ServerThread, build_server
    app, async_engine = build_server(EngineConfig(num_kv_blocks=64, max_model_len=256), log_interval=0,
                                     engine_core_mode="process")
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        r = c.post("/v1/completions", json={"prompt": "word:", "max_tokens": 40, "temperature": 0,
                                            "guided_grammar": GRAMMAR_FAILING_AFTER_A_WORD})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_grammar", r.text
        assert "failed after" in r.json()["error"]["message"]
        from metrics_scrape import wait_idle
        after = wait_idle(srv)
        assert after["pagedserve:structured_output_errors_total{}"] == 1
        ok = c.post("/v1/completions", json={"prompt": "x", "guided_choice": CHOICES, "max_tokens": 16,
                                             "temperature": 1.0, "seed": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in CHOICES
