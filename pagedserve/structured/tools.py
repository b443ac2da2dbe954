"""Tool calls of the chat API: the constraint a tool_choice puts on the text, and how the
constrained text becomes OpenAI tool_calls (whole, or streamed as deltas).

    tool_choice "none"      no constraint, no tool call (the text is the answer)
    tool_choice {function}  the text IS the arguments: a JSON value under that function's
                            parameters schema; one call
    tool_choice "required"  the text is a JSON array [{"name": ..., "parameters": {...}}, ...]
                            of at least one call (at most one with parallel_tool_calls=false),
                            each element tied to one function's schema by an anyOf on "name"
    tool_choice "auto"      free text, read by a model-specific parser (tool_parsers.py)

The streams below turn a growing text into OpenAI delta tool calls as vLLM sends them: the
first delta of a call carries its index, id, type and function name (arguments ""), the
following ones carry argument text only. Concatenating every delta's arguments gives the
call's arguments JSON string.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from pagedserve.structured.params import StructuredOutputsParams

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON string, as OpenAI sends it
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def function_parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """JSON schema of a list of calls, each one of `tools` with its own arguments schema."""
    alternatives = [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                       "parameters": function_parameters(t)},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    } for t in tools]
    schema: dict = {"type": "array", "minItems": 1, "items": alternatives[0] if len(alternatives) == 1
                    else {"anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_choice_constraint(tools: list[dict], tool_choice, parallel: bool) -> StructuredOutputsParams | None:
    """The constraint a tool_choice puts on the text (None for "none" and "auto")."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tool = next(t for t in tools if t["function"]["name"] == name)
        return StructuredOutputsParams(json=function_parameters(tool), field=f"tools[{tools.index(tool)}]"
                                       ".function.parameters")
    if tool_choice == "required":
        return StructuredOutputsParams(json=required_schema(tools, parallel), field="tools")
    return None


def calls_from_required(text: str) -> list[ToolCall]:
    """Calls from the text a "required" constraint produced (a JSON array of calls). A text cut
    short (max_tokens, a stop string) gives the calls begun in it, the last one with its arguments
    as far as they got: exactly what the stream of that text sent (RequiredCallStream), so a
    whole answer and its stream agree, and the array's own shape never reaches the client."""
    try:
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
    except ValueError:
        pass
    stream = RequiredCallStream()
    calls: list[ToolCall] = []
    for delta in stream.feed(text)[1]:
        if "id" in delta:
            calls.append(ToolCall(delta["function"]["name"], delta["function"]["arguments"], delta["id"]))
        else:
            calls[delta["index"]].arguments += delta["function"]["arguments"]
    return calls


# -- streaming --------------------------------------------------------------------------
def call_delta(index: int, call_id: str | None = None, name: str | None = None, arguments: str = "") -> dict:
    delta: dict = {"index": index}
    if call_id is not None:
        delta.update({"id": call_id, "type": "function"})
    function: dict = {}
    if name is not None:
        function["name"] = name
    function["arguments"] = arguments
    delta["function"] = function
    return delta


class NamedCallStream:
    """tool_choice {function}: the whole text streams as that call's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.call_id = make_tool_call_id()
        self.started = False
        self.called = True

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if not self.started:
            self.started = True
            return "", [call_delta(0, self.call_id, self.name, text)]
        return "", [call_delta(0, arguments=text)] if text else []

    def finish(self) -> tuple[str, list[dict]]:
        return "", []


class RequiredCallStream:
    """tool_choice "required": scans the JSON array of {"name", "parameters"} objects as it
    grows; a call's header goes out once its name is complete, its parameters' text as it
    comes. The grammar guarantees the shape (parameters are JSON objects, as OpenAI's function
    parameters are); the scanner only tracks strings and depth."""

    def __init__(self) -> None:
        self.called = True
        self._text = ""
        self._pos = 0            # next character to scan
        self._depth = 0          # bracket depth: 1 = inside the array, 2 = inside a call object
        self._in_string = False
        self._escaped = False
        self._index = -1         # current call
        self._key: str | None = None       # the last key read at depth 2
        self._string_start = 0
        self._value_start: int | None = None  # where the parameters' text starts
        self._sent = 0                         # of the parameters' text, characters sent
        self._name: str | None = None
        self._pending_args = ""                # parameters text seen before the name (schema order)
        self._last_string = ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._text += text
        deltas: list[dict] = []
        text = self._text
        while self._pos < len(text):
            ch = text[self._pos]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    self._end_string(text[self._string_start:self._pos + 1], deltas)
            elif ch == '"':
                self._in_string = True
                self._string_start = self._pos
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._index += 1
                    self._name, self._key, self._pending_args = None, None, ""
                if self._depth == 3 and self._key == "parameters" and self._value_start is None:
                    self._value_start, self._sent = self._pos, 0
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 2 and self._value_start is not None:
                    self._flush_args(self._pos + 1, deltas)
                    self._value_start = None
            elif ch == ":" and self._depth == 2:
                self._key = self._last_string
            self._pos += 1
        if self._value_start is not None:
            self._flush_args(len(text), deltas)
        return "", deltas

    def _end_string(self, literal: str, deltas: list[dict]) -> None:
        value = json.loads(literal)
        self._last_string = value
        if self._depth == 2 and self._key == "name" and self._name is None and self._value_start is None:
            self._name = value
            self._key = None
            deltas.append(call_delta(self._index, make_tool_call_id(), value, self._pending_args))
            self._pending_args = ""

    def _flush_args(self, end: int, deltas: list[dict]) -> None:
        piece = self._text[self._value_start + self._sent:end]
        self._sent = end - self._value_start
        if not piece:
            return
        if self._name is None:
            self._pending_args += piece
        else:
            deltas.append(call_delta(self._index, arguments=piece))

    def finish(self) -> tuple[str, list[dict]]:
        return "", []
