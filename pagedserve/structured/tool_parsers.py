"""Tool-call parsers for tool_choice "auto" (`--tool-call-parser`, vLLM's names): a model
writes calls in its own format, and the parser finds them in the text.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen 2.5/3):
                 content is the text before the first <tool_call>
    llama3_json  the whole answer is {"name": ..., "parameters": {...}} (Llama 3.1/3.2 JSON
                 tool calling), optionally after <|python_tag|>, several separated by ";";
                 an answer that does not start so is plain content

`extract(text)` reads a finished text: (content or None, calls). `stream()` gives an
object whose feed(delta_text) returns (content delta, tool-call deltas) and finish()
flushes: content streams as it comes (holding back only what could still turn out to be
the start of a call), and each call goes out whole, in one delta, once its JSON is complete.
Text that looks like a call but does not parse stays content, as in vLLM.
"""
from __future__ import annotations

import json
from typing import Callable

from pagedserve.structured.tools import ToolCall, call_delta, make_tool_call_id


def _call_from(obj, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arguments_keys:
        if key in obj:
            args = obj[key]
            return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    return ToolCall(obj["name"], "{}")


class HermesToolParser:
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        first = text.find(self.start)
        if first < 0:
            return text, []
        calls = []
        pos = first
        while pos >= 0:
            body_start = pos + len(self.start)
            stop = text.find(self.end, body_start)
            body = text[body_start:] if stop < 0 else text[body_start:stop]
            call = self._parse(body)
            if call is None:
                return text, []  # not a well-formed call: the model's text, unchanged
            calls.append(call)
            if stop < 0:
                break
            pos = text.find(self.start, stop + len(self.end))
        content = text[:first]
        return (content if content.strip() else None), calls

    @staticmethod
    def _parse(body: str) -> ToolCall | None:
        try:
            return _call_from(json.loads(body.strip()), ("arguments", "parameters"))
        except ValueError:
            return None

    def stream(self) -> "HermesStream":
        return HermesStream(self)


class HermesStream:
    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self.buffer = ""        # text not yet handed out (content tail or a call being read)
        self.in_call = False
        self.num_calls = 0
        self.called = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, deltas = "", []
        start, end = self.parser.start, self.parser.end
        while True:
            if not self.in_call:
                at = self.buffer.find(start)
                if at < 0:
                    keep = _partial_suffix(self.buffer, start)
                    cut = len(self.buffer) - keep
                    content += self._outside(self.buffer[:cut])
                    self.buffer = self.buffer[cut:]
                    return content, deltas
                content += self._outside(self.buffer[:at])
                self.buffer = self.buffer[at + len(start):]
                self.in_call = True
            at = self.buffer.find(end)
            if at < 0:
                return content, deltas
            content += self._emit(self.buffer[:at], deltas, start + self.buffer[:at + len(end)])
            self.buffer = self.buffer[at + len(end):]
            self.in_call = False

    def _outside(self, text: str) -> str:
        """Text outside the tags: content before the first call, as extract() has it."""
        return "" if self.called else text

    def _emit(self, body: str, deltas: list[dict], raw: str) -> str:
        """A call's delta, or (it does not parse) its raw text as content."""
        call = self.parser._parse(body)
        if call is None:
            return self._outside(raw)
        deltas.append(call_delta(self.num_calls, call.id, call.name, call.arguments))
        self.num_calls += 1
        self.called = True
        return ""

    def finish(self) -> tuple[str, list[dict]]:
        deltas: list[dict] = []
        if self.in_call:  # the text ended inside a call (EOS before </tool_call>)
            rest = self._emit(self.buffer, deltas, self.parser.start + self.buffer)
        else:
            rest = self._outside(self.buffer)
        self.buffer = ""
        return rest, deltas


class Llama3JsonToolParser:
    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def _body(self, text: str) -> str | None:
        stripped = text.lstrip()
        if stripped.startswith(self.python_tag):
            return stripped[len(self.python_tag):]
        return stripped if stripped.startswith("{") else None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = self._body(text)
        if body is None:
            return text, []
        calls, rest = _decode_calls(body)
        if not calls or rest.strip():
            return text, []
        return None, calls

    def stream(self) -> "Llama3JsonStream":
        return Llama3JsonStream(self)


def _decode_calls(body: str) -> tuple[list[ToolCall], str]:
    """Complete call objects at the start of body, separated by ';' and whitespace; the rest."""
    decoder = json.JSONDecoder()
    calls = []
    pos = 0
    while True:
        while pos < len(body) and (body[pos].isspace() or (calls and body[pos] == ";")):
            pos += 1
        if pos >= len(body) or body[pos] != "{":
            return calls, body[pos:]
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return calls, body[pos:]
        call = _call_from(obj, ("parameters", "arguments"))
        if call is None:
            return calls, body[pos:]
        calls.append(call)
        pos = end


class Llama3JsonStream:
    """Undecided until the first non-blank text: a call starts with '{' or the python tag."""

    def __init__(self, parser: Llama3JsonToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.mode: str | None = None  # None (undecided), "content", "calls"
        self.num_sent = 0
        self.called = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        if self.mode is None:
            stripped = self.text.lstrip()
            if not stripped or self.parser.python_tag.startswith(stripped):
                return "", []
            self.mode = "calls" if self.parser._body(self.text) is not None else "content"
            if self.mode == "content":
                return self.text, []
        if self.mode == "content":
            return text, []
        calls, _ = _decode_calls(self.parser._body(self.text))
        return "", self._new(calls)

    def _new(self, calls: list[ToolCall]) -> list[dict]:
        deltas = [call_delta(i, make_tool_call_id(), c.name, c.arguments)
                  for i, c in enumerate(calls) if i >= self.num_sent]
        self.num_sent = max(self.num_sent, len(calls))
        self.called = self.called or bool(deltas)
        return deltas

    def finish(self) -> tuple[str, list[dict]]:
        if self.mode is None:
            return self.text, []
        if self.mode == "calls" and not self.called:
            return self.text, []  # never parsed as a call: it was content after all
        return "", []


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


TOOL_PARSERS: dict[str, Callable[[], object]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str):
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; choose from {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
