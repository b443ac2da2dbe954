"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from pagedserve.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# OpenAI's limits on logit_bias: at most this many entries, each bias in [-100, 100].
MAX_LOGIT_BIAS_ENTRIES = 300
LOGIT_BIAS_LIMIT = 100.0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top-k (first token: None)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
        self.validate()

    def validate(self) -> None:
        def check(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name}: {msg}")

        check(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
              "temperature", f"must be >= 0, got {self.temperature!r}")
        check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        check(_is_int(self.top_k) and self.top_k >= 0, "top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and -2 <= v <= 2, name, f"must be in [-2, 2], got {v!r}")
        check(isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0,
              "repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        check(self.seed is None or _is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative integers")
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens",
                  f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        check(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
              "logprobs", f"must be an integer >= 0, got {self.logprobs!r}")
        check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
              "prompt_logprobs", f"must be an integer >= 0, got {self.prompt_logprobs!r}")
        self._validate_logit_bias()
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be a StructuredOutputsParams")

    def _validate_logit_bias(self) -> None:
        """Shape and range only; token ids against the vocabulary: InputProcessor.validate."""
        bias = self.logit_bias
        if bias is None:
            return
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias: keys must be token ids (integers >= 0), got {token!r}")
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT):
                raise ValueError(f"logit_bias: the bias of token {token} must be a number in "
                                 f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {value!r}")

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to apply to the logits first: its token is the row's argmax."""
        return (self.greedy and not self.logit_bias and self.structured_outputs is None and not self.min_tokens
                and self.repetition_penalty == 1.0 and not self.frequency_penalty and not self.presence_penalty
                and self.logprobs is None)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def child(self, index: int) -> "SamplingParams":
        """Params for the index-th of n parallel samples: n=1, and a distinct seed if seeded.
        Prompt logprobs are the prompt's, not a sample's: only sample 0 computes them."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)
