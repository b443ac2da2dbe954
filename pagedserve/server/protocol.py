"""OpenAI-compatible request bodies (pydantic), with vLLM's extra sampling fields.

Only the shape is checked here; the values are checked by SamplingParams and the engine's
InputProcessor.validate, whose ValueErrors name the field. Unknown fields are ignored, as
vLLM and OpenAI do. Shape rules, as OpenAI applies them:
- types are strict: "stream": "yes" or "n": "2" is a 400, not a guess (an int is a float);
- null means the field's default, for every field;
- numbers are finite; text is valid Unicode (a lone surrogate, which JSON can spell as
  "\ud800", is a 400 naming the field, not a tokenizer crash).
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Seconds a 503 asks the client to wait (Retry-After): a full queue, a draining server.
RETRY_AFTER_SECONDS = 1


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    """OpenAI's error object, as every error this server sends (JSON, SSE event, 408, 503) carries it."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}

# torch.Generator.manual_seed takes [-2**63, 2**64); n samples use seed + i.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _check_unicode(value: Any, path: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{path}: not valid Unicode (a lone surrogate at character {e.start})") from None
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, item in value.items():
            _check_unicode(item, f"{path}.{k}")


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, populate_by_name=True)
    refused_fields: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            _check_unicode(value, key)
            harmless = cls.refused_fields.get(key)
            if harmless is not None and value is not None and value not in harmless:
                raise ValueError(f"{key}: not supported by this server (see the request field table in docs/api.md)")
        return {k: v for k, v in data.items() if v is not None}


class _Strict(_Base):
    """A nested object whose every key this server reads: an unknown key is a 400, not ignored."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced (as strict=true)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` (exactly one of these)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # json only: false keeps JSON Schema's open objects (the default closes those that do not say)
    disable_additional_properties: bool | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments are always held to the schema under "required" / named choice


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# Fields of the OpenAI and vLLM request bodies that this server does not implement: sending
# one with a value other than the harmless ones listed is a 400 naming it (never ignored).
# The value set holds what is accepted because it asks for nothing (e.g. store=false).
REFUSED_FIELDS: dict[str, tuple] = {
    "functions": (), "function_call": (),  # the deprecated spelling of tools: use tools/tool_choice
    "audio": (), "prediction": (), "web_search_options": (), "reasoning_effort": (),
    "modalities": (["text"],), "store": (False,), "metadata": (), "service_tier": ("auto", "default"),
    "use_beam_search": (False,), "length_penalty": (1.0, 1), "truncate_prompt_tokens": (),
    "allowed_token_ids": (), "bad_words": ([],), "spaces_between_special_tokens": (True,),
    "documents": (), "chat_template": (), "mm_processor_kwargs": (), "return_tokens_as_token_ids": (False,),
    "cache_salt": (), "guided_whitespace_pattern": (), "structural_tag": (), "guided_decoding_backend": (),
    "kv_transfer_params": (), "vllm_xargs": (), "prompt_embeds": (), "return_token_ids": (False,),
    "logits_processors": (), "thinking": (), "include_reasoning": (),
}


class StreamOptions(_Base):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Base):
    """Sampling parameters shared by completions and chat (OpenAI's, then vLLM's extras)."""

    refused_fields: ClassVar[dict[str, tuple]] = REFUSED_FIELDS

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    # completions tokenize the prompt with special tokens (a BOS where the tokenizer adds one)
    refused_fields: ClassVar[dict[str, tuple]] = {**REFUSED_FIELDS, "add_special_tokens": (True,)}
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatContentPart(_Base):
    type: str
    text: str | None = None


class ToolCallFunction(_Base):
    name: str
    arguments: str


class ToolCallMessage(_Base):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Base):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None                  # a tool turn: which call it answers


class ChatCompletionRequest(_SamplingFields):
    # the chat template writes the special tokens itself
    refused_fields: ClassVar[dict[str, tuple]] = {**REFUSED_FIELDS, "add_special_tokens": (False,)}
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


FinishReason = Literal["stop", "length", "abort"]
