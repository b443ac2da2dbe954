"""The checkpoint's tokenizer, loaded the one way every front-end and rank loads it, and
the structured-outputs grammar compiler built on it, the one way too."""
from __future__ import annotations

import logging

from pagedserve.config import EngineConfig, ResolvedConfig
from pagedserve.structured.compiler import make_grammar_compiler

logger = logging.getLogger("pagedserve.engine")


def load_tokenizer(config: EngineConfig):
    from transformers import AutoTokenizer
    path = config.tokenizer or config.model
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # a checkpoint without tokenizer files can still run token ids
        logger.warning("no tokenizer loaded from %s (%s); only token-id prompts will work", path, e)
        return None


def grammar_compiler_for(settings: ResolvedConfig, tokenizer):
    """Structured outputs' compiler for this engine's vocabulary and eos ids (None without a
    tokenizer): the front-end's, for the requests it checks, and the sampling rank's."""
    return make_grammar_compiler(tokenizer, settings.vocab_size, settings.eos_token_ids,
                                 settings.config.structured_outputs_cache_bytes)


class LazyGrammarCompiler:
    """The grammar compiler of a sampling rank or an engine-core process, built (tokenizer
    loaded) on the first request with structured outputs rather than at start-up: loading the
    tokenizer imports transformers, about half the CPU time of a core's start, and only
    structured outputs need it there (the API process has its own tokenizer and compiler, and
    checks every grammar before a request reaches a core). The first such request waits once."""

    def __init__(self, build) -> None:
        self._build = build
        self._compiler = None
        self._built = False

    def new_matcher(self, spec):
        if not self._built:
            self._compiler, self._built = self._build(), True
        if self._compiler is None:  # no tokenizer: as when the runner has no compiler at all
            raise ValueError("structured_outputs: this executor has no grammar compiler")
        return self._compiler.new_matcher(spec)
