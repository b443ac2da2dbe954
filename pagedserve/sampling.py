"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, replace

_GREEDY_EPS = 1e-5


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
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
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

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def child(self, index: int) -> "SamplingParams":
        """Params for the index-th of n parallel samples: n=1, and a distinct seed if seeded."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
