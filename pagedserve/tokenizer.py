"""The checkpoint's tokenizer, loaded the one way every front-end and rank loads it."""
from __future__ import annotations

import logging

from pagedserve.config import EngineConfig

logger = logging.getLogger("pagedserve.engine")


def load_tokenizer(config: EngineConfig):
    from transformers import AutoTokenizer
    path = config.tokenizer or config.model
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # a checkpoint without tokenizer files can still run token ids
        logger.warning("no tokenizer loaded from %s (%s); only token-id prompts will work", path, e)
        return None
