"""StructuredOutputsParams: the constraint one request puts on its text (vLLM's name and fields).

Plain, hashable data: it travels inside SamplingParams to the executor once, and its
`cache_key` names the compiled grammar in the compiler's cache, so requests with the same
schema share one compilation. Exactly one of json / regex / choice / grammar / json_object
is set. `field` is the request field the constraint came from (e.g. "response_format"),
so an error about it can name what the caller actually sent; it is not part of the key.

`disable_additional_properties` (vLLM's name): an object schema that lists `properties` and
says nothing about other keys is closed (`additionalProperties: false`), as vLLM's default
backend (xgrammar) does; False keeps JSON Schema's open default. A schema that sets
additionalProperties itself is always followed.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | None = None          # a JSON schema, as JSON text (a dict is serialised)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None       # Lark, or llama.cpp GBNF
    json_object: bool | None = None  # any JSON object
    disable_additional_properties: bool = True  # json: close objects that do not say (see above)
    field: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            try:
                text = _json.dumps(self.json)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{self.field}: the JSON schema is not serialisable: {e}") from None
            object.__setattr__(self, "json", text)
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is False:
            object.__setattr__(self, "json_object", None)
        self.validate()

    def validate(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) is not None]
        if len(set_kinds) != 1:
            raise ValueError(f"{self.field}: give exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(set_kinds) or 'none'}")
        kind = set_kinds[0]
        if not isinstance(self.disable_additional_properties, bool):
            raise ValueError(f"{self.field}: disable_additional_properties must be true or false")
        if kind == "json":
            try:
                schema = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"{self.field}: the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{self.field}: a JSON schema must be an object, got {type(schema).__name__}")
        elif kind == "choice":
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{self.field}: choice must be a non-empty list of non-empty strings")
        elif kind in ("regex", "grammar"):
            if not isinstance(getattr(self, kind), str) or not getattr(self, kind):
                raise ValueError(f"{self.field}: {kind} must be a non-empty string")
        elif self.json_object is not True:
            raise ValueError(f"{self.field}: json_object must be true")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def cache_key(self) -> tuple:
        if self.kind == "json":
            return self.kind, self.json, self.disable_additional_properties
        return self.kind, getattr(self, self.kind)

    def schema(self) -> dict | bool | None:
        """The JSON schema this constraint stands for (json and json_object), else None."""
        if self.json is not None:
            return _json.loads(self.json)
        if self.json_object:
            return {"type": "object"}
        return None
