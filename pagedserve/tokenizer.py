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
