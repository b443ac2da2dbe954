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

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            _check_unicode(value, key)
        return {k: v for k, v in data.items() if v is not None}


class StreamOptions(_Base):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Base):
    """Sampling parameters shared by completions and chat (OpenAI's, then vLLM's extras)."""

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


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None


class ChatContentPart(_Base):
    type: str
    text: str | None = None


class ChatMessage(_Base):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
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
