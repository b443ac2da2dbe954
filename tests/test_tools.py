"""Tool calls. Named and "required" tool_choice hold the arguments to the function's JSON
schema with any model (checked with `jsonschema` on the built-in model's answers), and come
back OpenAI-shaped, streamed or not (the streamed deltas reassemble into the same calls).
"auto" reads the model's own format: the hermes and llama3_json parsers are checked on
texts such models write, whole and cut into random stream pieces, and end to end by making
the built-in model write a hermes call through a regex constraint."""
from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest

from pagedserve.structured.tool_parsers import HermesToolParser, Llama3JsonToolParser, get_tool_parser

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- parsers on recorded model texts ---------------------------------------------------------
HERMES_TEXTS = [
    # (model text, expected content, expected [(name, arguments)])
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>',
     "Let me check both.\n", [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": 1})]),
    ("The weather in Paris is mild today; no tool needed.", "The weather in Paris is mild today; no tool needed.", []),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": -5}}', None, [("get_time", {"zone": -5})]),  # no end tag
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>',  # broken JSON: stays text
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>', []),
]
LLAMA3_TEXTS = [
    ('{"name": "get_weather", "parameters": {"city": "Rome", "unit": "fahrenheit"}}',
     None, [("get_weather", {"city": "Rome", "unit": "fahrenheit"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": 9}}; {"name": "get_weather", "parameters": '
     '{"city": "Tokyo", "unit": "celsius"}}',
     None, [("get_time", {"zone": 9}), ("get_weather", {"city": "Tokyo", "unit": "celsius"})]),
    ("I cannot call tools for that.", "I cannot call tools for that.", []),
    ('{"name": "get_time", "arguments": {"zone": 3}}', None, [("get_time", {"zone": 3})]),
    ('{"nome": 1}', '{"nome": 1}', []),
]


def _stream(parser, text: str, seed: int) -> tuple[str, list[tuple[str, dict]]]:
    """Feed the text in random pieces; reassemble content and calls from the deltas."""
    rng = random.Random(seed)
    stream = parser.stream()
    content, calls = "", {}
    pos = 0
    pieces = []
    while pos < len(text):
        n = rng.randint(1, 6)
        pieces.append(text[pos:pos + n])
        pos += n
    for piece in pieces:
        c, deltas = stream.feed(piece)
        content += c
        _merge(calls, deltas)
    c, deltas = stream.finish()
    content += c
    _merge(calls, deltas)
    return content, [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]


def _merge(calls: dict, deltas: list[dict]) -> None:
    for d in deltas:
        call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
        if "id" in d:
            assert d["type"] == "function" and d["id"].startswith("chatcmpl-tool-") and call["id"] is None
            call["id"], call["name"] = d["id"], d["function"]["name"]
        call["arguments"] += d["function"]["arguments"]


@pytest.mark.parametrize("parser,cases", [(HermesToolParser(), HERMES_TEXTS), (Llama3JsonToolParser(), LLAMA3_TEXTS)])
def test_parsers_on_recorded_texts_whole_and_streamed(parser, cases):
    for text, content, expected in cases:
        got_content, calls = parser.extract(text)
        assert got_content == content
        assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
        for seed in range(20):
            streamed_content, streamed_calls = _stream(parser, text, seed)
            assert streamed_calls == expected
            assert streamed_content == (content or ""), (seed, streamed_content)


@pytest.mark.parametrize("calls", [
    [{"name": "get_weather", "parameters": {"city": "P\\\"s}", "unit": "celsius"}}, {"name": "get_time", "parameters": {}}],
    [{"parameters": {"zone": [1, {"x": "]"}]}, "name": "get_time"}],  # parameters before the name
])
def test_required_stream_scanner_on_text_pieces(calls):
    from pagedserve.structured.tools import RequiredCallStream
    text = json.dumps(calls)
    for seed in range(30):
        rng = random.Random(seed)
        stream, merged, pos = RequiredCallStream(), {}, 0
        while pos < len(text):
            n = rng.randint(1, 5)
            _merge(merged, stream.feed(text[pos:pos + n])[1])
            pos += n
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(merged.items())] == \
            [(c["name"], c["parameters"]) for c in calls]


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="^tool_call_parser: unknown parser"):
        get_tool_parser("mistral_v9")


# -- end to end with the built-in model ------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    from pagedserve.config import EngineConfig
    from pagedserve.server.launcher import ServerThread, build_server
    app, _ = build_server(EngineConfig(num_kv_blocks=64, max_model_len=512), enable_auto_tool_choice=True,
                          tool_call_parser="hermes")
    with ServerThread(app) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield c


def _chat(client, **body):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _check_calls(tool_calls, names=None):
    assert tool_calls
    for call in tool_calls:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert isinstance(call["function"]["arguments"], str)
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA_OF[call["function"]["name"]])
        if names is not None:
            assert call["function"]["name"] in names


@pytest.mark.parametrize("seed", range(4))
def test_named_tool_choice_holds_arguments_to_the_schema(client, seed):
    for name in ("get_weather", "get_time"):
        choice = _chat(client, tool_choice={"type": "function", "function": {"name": name}}, temperature=1.0, seed=seed)
        assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"
        assert len(choice["message"]["tool_calls"]) == 1
        _check_calls(choice["message"]["tool_calls"], {name})


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_returns_valid_calls(client, seed):
    choice = _chat(client, tool_choice="required", temperature=1.0, seed=seed, max_tokens=200)
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    _check_calls(choice["message"]["tool_calls"], set(SCHEMA_OF))
    single = _chat(client, tool_choice="required", temperature=1.0, seed=seed, parallel_tool_calls=False)
    assert len(single["message"]["tool_calls"]) == 1


def test_none_tool_choice_is_plain_text(client):
    choice = _chat(client, tool_choice="none", temperature=0, max_tokens=10)
    assert "tool_calls" not in choice["message"] and isinstance(choice["message"]["content"], str)


def _streamed_chat(client, **body) -> tuple[str, dict, str]:
    calls: dict = {}
    content, finish = "", None
    first_delta = None
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": MESSAGES, "tools": TOOLS, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            first_delta = first_delta or delta
            content += delta.get("content") or ""
            _merge(calls, delta.get("tool_calls", []))
            finish = choice["finish_reason"] or finish
    assert first_delta.get("role") == "assistant"
    return content, calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_reassemble_to_the_same_calls(client, tool_choice):
    body = {"tool_choice": tool_choice, "temperature": 1.0, "seed": 11, "max_tokens": 200}
    whole = _chat(client, **body)
    content, calls, finish = _streamed_chat(client, **body)
    assert content == "" and finish == whole["finish_reason"]
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]]


HERMES_REGEX = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,6}", '
                r'"unit": "(celsius|fahrenheit)"\}\}</tool_call>')


def test_auto_with_hermes_parser_end_to_end(client):
    """The built-in model cannot call tools by itself: a regex makes it write a hermes call,
    which the auto path must find, whole and streamed."""
    body = {"tool_choice": "auto", "structured_outputs": {"regex": HERMES_REGEX}, "temperature": 1.0, "seed": 2}
    choice = _chat(client, **body)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    _check_calls(choice["message"]["tool_calls"], {"get_weather"})
    content, calls, finish = _streamed_chat(client, max_tokens=120, **body)
    assert finish == "tool_calls" and content == ""
    assert [json.loads(c["arguments"]) for c in calls.values()] == \
        [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    plain = _chat(client, tool_choice="auto", temperature=0, max_tokens=8)  # no call in the text: content
    assert "tool_calls" not in plain["message"] and plain["finish_reason"] == "length"


def test_tool_history_reaches_the_template(client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, body, param):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_auto_needs_the_flag():
    from pagedserve.config import EngineConfig
    from pagedserve.server.launcher import ServerThread, build_server
    app, _ = build_server(EngineConfig(num_kv_blocks=64, max_model_len=256))
    with ServerThread(app) as srv:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


def test_serve_flags():
    from pagedserve.cli import build_parser
    from pagedserve.server.cli import server_settings
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    settings = server_settings(args)
    assert settings["enable_auto_tool_choice"] is True and settings["tool_call_parser"] == "llama3_json"
    with pytest.raises(ValueError, match="^enable_auto_tool_choice: needs --tool-call-parser"):
        server_settings(build_parser().parse_args(["serve", "--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):  # argparse refuses an unknown parser name
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])


# -- request fields that are honoured or refused, never ignored ------------------------------
@pytest.mark.parametrize("field,value", [
    ("store", True), ("functions", [{"name": "f"}]), ("function_call", "auto"), ("modalities", ["audio"]),
    ("service_tier", "flex"), ("use_beam_search", True), ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]),
    ("reasoning_effort", "low"), ("add_special_tokens", True), ("priority", 3),
    ("structured_outputs", {"json": {"type": "object"}, "disable_any_whitespace": True}),
])
def test_fields_not_honoured_are_400s_naming_them(client, field, value):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field, r.json()


def test_harmless_values_and_user_are_accepted(client):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "store": False,
                                                  "modalities": ["text"], "service_tier": "auto", "user": "u-1",
                                                  "add_special_tokens": False, "priority": 0})
    assert r.status_code == 200, r.text


def test_continuous_usage_stats_put_usage_on_every_chunk(client):
    """Every chunk's usage counts the tokens streamed so far, its own included: a chunk can carry
    several tokens (a stream that fell behind gets what queued up as one chunk), so each chunk's
    tokens are counted from its logprobs."""
    body = {"messages": MESSAGES, "max_tokens": 5, "ignore_eos": True, "stream": True, "logprobs": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    assert chunks and all(c["usage"] is not None for c in chunks)
    streamed, counts = 0, []
    for c in chunks[:-1]:
        streamed += sum(len((ch.get("logprobs") or {}).get("content") or []) for ch in c["choices"])
        counts.append(c["usage"]["completion_tokens"])
        assert c["usage"]["completion_tokens"] == streamed, (counts, c)
        assert c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + streamed
    assert streamed == 5 and chunks[-1]["usage"]["completion_tokens"] == 5 and not chunks[-1]["choices"]
    assert counts == sorted(counts) and counts[0] >= 1


def test_chat_echo_prefixes_the_last_assistant_message(client):
    messages = MESSAGES + [{"role": "assistant", "content": "It is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 3, "temperature": 0}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    echoed = client.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "It is" + plain
