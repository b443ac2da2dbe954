"""Reproducibility of scripts/train_default_model.py: same seed, same held-out loss.

Marked `slow` (about 30-60 s: two tiny training runs in subprocesses). Run alone with
`pytest tests/test_default_model_training.py` or deselect with `-m "not slow"`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_default_model.py"
TINY_RUN = [
    "--seed", "0", "--steps", "20", "--threads", "1", "--max-corpus-mb", "0.3",
    "--vocab-size", "512", "--hidden-size", "64", "--num-layers", "2", "--num-heads", "2",
    "--num-kv-heads", "1", "--intermediate-size", "128", "--seq-len", "64", "--batch-size", "8",
    "--warmup-steps", "5", "--eval-windows", "16", "--log-every", "10",
]
RELATIVE_TOLERANCE = 1e-3


def _train(out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", RAYON_NUM_THREADS="1")
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *TINY_RUN], check=True, env=env,
                   capture_output=True, text=True, timeout=120)
    return json.loads((out / "training_summary.json").read_text())


def test_same_seed_reproduces_held_out_loss(tmp_path):
    first = _train(tmp_path / "run1")
    second = _train(tmp_path / "run2")
    assert first["steps"] == second["steps"] == 20
    assert first["train_tokens_in_corpus"] == second["train_tokens_in_corpus"]
    for key in ("held_out_loss_fp32", "held_out_loss_bf16"):
        assert second[key] == pytest.approx(first[key], rel=RELATIVE_TOLERANCE), key
    # The run learned something: loss is below that of a uniform guess over the vocabulary.
    assert first["held_out_loss_fp32"] < 6.24  # ln(512)
    assert (tmp_path / "run1" / "tokenizer.json").read_bytes() == (tmp_path / "run2" / "tokenizer.json").read_bytes()
