"""Structured outputs against an independent judge: every constrained text parses and
validates with `jsonschema` (or matches the regex / is one of the choices), at temperature
1.0 and under forced recompute preemption, with the built-in default model; greedy
constrained text is the same with and without preemption; the matcher's rollback gives the
same masks as a fresh matcher fed the same tokens; invalid constraints are a 400 naming
the field the caller used."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.structured import StructuredOutputsParams
from pagedserve.worker.sampler import unpack_bitmask

SCHEMAS = [
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "id": {"type": "integer", "minimum": 1, "maximum": 999}},
                 "required": ["name", "id"], "additionalProperties": False},
        "active": {"type": "boolean"}},
     "required": ["user", "active"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"type": "string", "enum": ["S", "M", "L"]}},
     "required": ["color", "size"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "minItems": 1, "maxItems": 4}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
                                      "count": {"type": "integer", "minimum": -5, "maximum": 5}},
     "required": ["score", "count"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 100},
                                                                 "ok": {"type": "boolean"}},
                                "required": ["x", "ok"], "additionalProperties": False},
     "minItems": 1, "maxItems": 3},
]
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys", "class Stack:", "# answer in JSON\n"]


@pytest.fixture(scope="module")
def llm_small_pool():
    # 40 blocks of 16 tokens for up to 50 running requests: the pool runs dry and recompute
    # preemption happens in the middle of constrained outputs.
    return LLM(num_kv_blocks=40, max_model_len=512, max_num_seqs=50, enable_prefix_caching=False,
               preemption_mode="recompute")


def test_fifty_json_schema_requests_validate_at_temperature_one_under_preemption(llm_small_pool):
    llm = llm_small_pool
    before = llm.engine.scheduler.total_preemptions
    prompts, params, schemas = [], [], []
    for i in range(50):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(PROMPTS[i % len(PROMPTS)])
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=200,
                                     structured_outputs=StructuredOutputsParams(json=schema)))
        schemas.append(schema)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.total_preemptions > before, "the pool was meant to force preemption"
    for out, schema in zip(outs, schemas):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", comp.text
        jsonschema.validate(json.loads(comp.text), schema)


def test_regex_and_choice_constraints(llm_small_pool):
    regex = r"[A-Z][a-z]{2,6}-\d{2,4}"
    choices = ["alpha", "beta", "gamma delta"]
    params = ([SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                              structured_outputs=StructuredOutputsParams(regex=regex)) for i in range(10)]
              + [SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                                structured_outputs=StructuredOutputsParams(choice=choices)) for i in range(10)])
    outs = llm_small_pool.generate([PROMPTS[i % 5] for i in range(20)], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(re.fullmatch(regex, t) for t in texts[:10]), texts[:10]
    assert all(t in choices for t in texts[10:]), texts[10:]
    assert len(set(texts[10:])) > 1  # temperature 1.0 really samples among the choices


def test_greedy_constrained_text_is_the_same_with_and_without_preemption(llm_small_pool):
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=s))
              for s in SCHEMAS] * 4
    prompts = [PROMPTS[i % 5] for i in range(20)]
    roomy = LLM(num_kv_blocks=400, max_model_len=512, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    assert roomy.engine.scheduler.total_preemptions == 0
    tight = LLM(num_kv_blocks=34, max_model_len=512, max_num_seqs=20, enable_prefix_caching=False,
                preemption_mode="recompute")
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.total_preemptions > 0
    assert got == expected


def _mask(matcher, words: int) -> np.ndarray:
    row = np.zeros(words, dtype=np.int32)
    matcher.fill_bitmask(row)
    return row


def test_matcher_sync_rolls_back_to_the_common_prefix(llm_small_pool):
    """A matcher synced to a rewritten history masks exactly like a fresh one fed that history."""
    compiler = llm_small_pool.engine.grammar_compiler
    spec = StructuredOutputsParams(json=SCHEMAS[2])
    tokenizer = llm_small_pool.get_tokenizer()
    first = tokenizer('{"tags": ["ab", "cd"', add_special_tokens=False).input_ids
    other = tokenizer('{"tags": ["x"]}', add_special_tokens=False).input_ids
    words = compiler.bitmask_words
    prompt = [5, 6, 7]
    m = compiler.new_matcher(spec)
    m.sync(prompt + first, len(prompt), len(prompt) + len(first))
    assert m.consumed == first
    for history in (other, first[:3], first, []):
        m.sync(prompt + history, len(prompt), len(prompt) + len(history))
        fresh = compiler.new_matcher(spec)
        for t in history:
            fresh.accept(t)
        assert m.consumed == history
        assert np.array_equal(_mask(m, words), _mask(fresh, words))
        assert not m.is_error


def test_unpack_bitmask_matches_bit_arithmetic():
    rng = np.random.default_rng(0)
    words = rng.integers(-2**31, 2**31, size=(3, 5), dtype=np.int64).astype(np.int32)
    vocab = 150
    allowed = unpack_bitmask(torch.from_numpy(words), vocab)
    for r in range(3):
        for t in range(vocab):
            assert bool(allowed[r, t]) == bool((int(words[r, t // 32]) >> (t % 32)) & 1)


def test_sampler_draws_only_allowed_tokens(llm_small_pool):
    """With random logits the allowed set of a fresh JSON matcher is {'{'}: every row picks it."""
    compiler = llm_small_pool.engine.grammar_compiler
    tokenizer = llm_small_pool.get_tokenizer()
    brace = tokenizer("{", add_special_tokens=False).input_ids
    assert len(brace) == 1
    m = compiler.new_matcher(StructuredOutputsParams(json=SCHEMAS[0]))
    allowed = unpack_bitmask(torch.from_numpy(_mask(m, compiler.bitmask_words)[None]), compiler.vocab_size)[0]
    assert allowed.nonzero().flatten().tolist() == brace


def test_invalid_constraints_refuse_before_queueing(llm_small_pool):
    with pytest.raises(ValueError, match=r"^structured_outputs: invalid json: .*nonsense"):
        llm_small_pool.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(
            json={"type": "object", "properties": {"a": {"type": "nonsense"}}})), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^structured_outputs: invalid regex"):
        llm_small_pool.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")),
                                use_tqdm=False)
    assert not llm_small_pool.engine.has_unfinished_requests()


def test_compiled_grammars_are_cached_by_schema(llm_small_pool):
    compiler = llm_small_pool.engine.grammar_compiler
    spec = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    n = compiler.num_compiled
    first = compiler.compile(StructuredOutputsParams(json=spec))
    again = compiler.compile(StructuredOutputsParams(json=json.dumps(spec), field="guided_json"))
    assert first is again and compiler.num_compiled == n + 1


# -- over HTTP ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    from pagedserve.config import EngineConfig
    from pagedserve.server.launcher import ServerThread, build_server
    app, _ = build_server(EngineConfig(num_kv_blocks=64, max_model_len=512))
    with ServerThread(app) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield c


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[1]}}},
    {"structured_outputs": {"json": SCHEMAS[1]}},
    {"guided_json": SCHEMAS[1]},
    {"guided_json": json.dumps(SCHEMAS[1])},
])
def test_every_json_schema_spelling_on_both_endpoints(client, body):
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a color"}],
                                                     "temperature": 1.0, "max_tokens": 60, **body})
    comp = client.post("/v1/completions", json={"prompt": "color:", "temperature": 1.0, "max_tokens": 60, **body})
    assert chat.status_code == comp.status_code == 200, (chat.text, comp.text)
    jsonschema.validate(json.loads(chat.json()["choices"][0]["message"]["content"]), SCHEMAS[1])
    jsonschema.validate(json.loads(comp.json()["choices"][0]["text"]), SCHEMAS[1])


def test_json_object_regex_choice_grammar_over_http(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 80,
                                                  "response_format": {"type": "json_object"}, "temperature": 0})
    content = r.json()["choices"][0]["message"]["content"]
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")
    r = client.post("/v1/completions", json={"prompt": "id:", "guided_regex": r"[a-f]{4}\d", "max_tokens": 20})
    assert re.fullmatch(r"[a-f]{4}\d", r.json()["choices"][0]["text"])
    r = client.post("/v1/completions", json={"prompt": "ok?", "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.json()["choices"][0]["text"] in ("yes", "no")
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
    r = client.post("/v1/completions", json={"prompt": "sum:", "guided_grammar": grammar, "max_tokens": 40,
                                             "temperature": 0})
    text = r.json()["choices"][0]["text"]
    assert r.json()["choices"][0]["finish_reason"] == "stop" and re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", text)


def test_streamed_constrained_text_validates(client):
    body = {"prompt": "json:", "stream": True, "max_tokens": 100, "temperature": 1.0, "seed": 5,
            "structured_outputs": {"json": SCHEMAS[4]}}
    text = ""
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"] if json.loads(line[6:])["choices"] else ""
    jsonschema.validate(json.loads(text), SCHEMAS[4])


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_json": {"properties": {"a": {"type": "nonsense"}}}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
])
def test_invalid_constraint_is_a_400_naming_the_field(client, body, param):
    r = client.post("/v1/completions", json={"prompt": "x", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
