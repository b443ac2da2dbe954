"""Where pagedserve's built-in default model lives, and the name it is served under.

The checkpoint in ``pagedserve/default_model/`` is a toy Llama (a few million parameters) trained
by ``scripts/train_default_model.py`` on the Python standard library's own sources. It lets
``pagedserve serve`` and ``pagedserve generate`` run on a machine with no model hub; it writes
Python-looking code and is not a useful assistant.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parent / "default_model"

_FALLBACK_NAME = "pagedserve-toy-llama-4m-pystdlib"


def _read_served_name(model_dir: Path) -> str:
    try:
        summary = json.loads((model_dir / "training_summary.json").read_text())
    except (OSError, ValueError):
        return _FALLBACK_NAME
    return str(summary.get("served_model_name") or _FALLBACK_NAME)


DEFAULT_MODEL_NAME: str = _read_served_name(DEFAULT_MODEL_DIR)

__all__ = ["DEFAULT_MODEL_DIR", "DEFAULT_MODEL_NAME"]
