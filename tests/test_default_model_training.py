"""Reproducibility of scripts/train_default_model.py: same seed, same held-out loss.

Marked `slow` (two tiny training runs in subprocesses, side by side; most of their time is the
script's corpus scan and encoding, not its 10 steps). Run alone with
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
    "--seed", "0", "--steps", "10", "--threads", "1", "--max-corpus-mb", "0.3",
    "--vocab-size", "512", "--hidden-size", "64", "--num-layers", "2", "--num-heads", "2",
    "--num-kv-heads", "1", "--intermediate-size", "128", "--seq-len", "64", "--batch-size", "8",
    "--warmup-steps", "3", "--eval-windows", "16", "--log-every", "10",
]
RELATIVE_TOLERANCE = 1e-3


def _train_twice(out1: Path, out2: Path) -> tuple[dict, dict]:
    """Both runs at once (one thread each), so a 2-core machine takes the time of one."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", RAYON_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "--out", str(out), *TINY_RUN], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for out in (out1, out2)]
    for proc in procs:
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log
    return tuple(json.loads((out / "training_summary.json").read_text()) for out in (out1, out2))


def test_same_seed_reproduces_held_out_loss(tmp_path):
    first, second = _train_twice(tmp_path / "run1", tmp_path / "run2")
    assert first["steps"] == second["steps"] == 10
    assert first["train_tokens_in_corpus"] == second["train_tokens_in_corpus"]
    for key in ("held_out_loss_fp32", "held_out_loss_bf16"):
        assert second[key] == pytest.approx(first[key], rel=RELATIVE_TOLERANCE), key
    # The run learned something: loss is below that of a uniform guess over the vocabulary.
    assert first["held_out_loss_fp32"] < 6.24  # ln(512)
    assert (tmp_path / "run1" / "tokenizer.json").read_bytes() == (tmp_path / "run2" / "tokenizer.json").read_bytes()
