"""Shared helpers for benchmarks: a random checkpoint of a chosen size, made on the fly."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab)  ~ parameter count
    "tiny": (64, 2, 4, 2, 128, 384),            # ~0.1M, smoke runs
    "20m": (384, 6, 6, 2, 1024, 8192),          # ~13M
    "100m": (768, 12, 12, 4, 2048, 32000),      # ~100M (tied embeddings)
}


def benchmark_checkpoint(size: str, cache_dir: Path | None = None) -> Path:
    from checkpoints import make_checkpoint

    hidden, layers, heads, kv_heads, inter, vocab = SIZES[size]
    path = (cache_dir or Path("/tmp/pagedserve-bench")) / f"llama-{size}"
    if not (path / "config.json").exists():
        make_checkpoint(path, "llama", hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, inter=inter,
                        vocab=vocab, max_pos=2048, init_std=0.02, tie_word_embeddings=True)
    return path


def param_count(path: Path) -> int:
    cfg = json.loads((path / "config.json").read_text())
    h, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return v * h + L * per_layer + h + (0 if cfg.get("tie_word_embeddings") else v * h)


def write_result(name: str, result: dict) -> Path:
    out = ROOT / "results"
    out.mkdir(exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2))
    return path
