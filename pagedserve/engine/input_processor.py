"""InputProcessor: text -> token ids, and every check a request must pass before it is queued.

Each check raises one ValueError whose message starts with the field it names; nothing is
queued until all of them pass, so a refused request changes nothing.
"""
from __future__ import annotations

from typing import Sequence

from pagedserve.config import EngineConfig
from pagedserve.core.engine_core import check_request_length
from pagedserve.sampling import SamplingParams


class InputProcessor:
    def __init__(self, config: EngineConfig, vocab_size: int, tokenizer, grammar_compiler=None) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.grammar_compiler = grammar_compiler  # structured.compiler.GrammarCompiler, None without a tokenizer

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; send token ids instead")
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (with the numbers) for a request that cannot run; changes nothing."""
        vocab = self.vocab_size
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt: must contain at least one token")
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        check_request_length(len(prompt_token_ids), params.max_tokens, self.config.max_model_len)
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs: at most {self.config.max_logprobs}, got {params.logprobs}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must be below the vocabulary size {vocab}")
        if params.seed is not None and not -2**63 <= params.seed < 2**63:
            raise ValueError(f"seed: must fit a signed 64-bit integer, got {params.seed}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; use stop_token_ids")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.config.max_logprobs:
            raise ValueError(f"prompt_logprobs: at most {self.config.max_logprobs}, got {params.prompt_logprobs}")
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            bad = next(t for t in params.logit_bias if t >= vocab)
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")
        if params.structured_outputs is not None:
            self.compile_grammar(params)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile (or find cached) the request's grammar now, on the caller's thread, so the
        engine's step only copies it. An invalid schema is a ValueError naming its field."""
        spec = params.structured_outputs
        if self.grammar_compiler is None:
            raise ValueError(f"{spec.field}: structured outputs need the model's tokenizer, and this model has none")
        self.grammar_compiler.compile(spec)
