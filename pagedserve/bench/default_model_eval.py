"""Held-out evaluation of the built-in model through the engine: perplexity by teacher forcing
and greedy agreement between two engine configurations (e.g. two KV cache dtypes).

The held-out text is the rule of scripts/train_default_model.py: the running interpreter's
standard-library `.py` files in sorted path order, skipping SKIP_DIRS, every HELD_OUT_EVERYth
file held out of training. On CPython 3.11.7 (the interpreter the model was trained on) those
are exactly the 23 files training_summary.json counts; on another interpreter they are other
Python sources, still code the model writes but partly seen in training.

Teacher forcing runs each window as a prompt with `prompt_logprobs=0`. Give the engine a small
`max_num_batched_tokens` so each window is prefilled in chunks: every chunk after the first then
reads its keys and values back from the cache the engine wrote, which is where a KV cache dtype
acts (a single fresh chunk sees its own K/V only as the cache would round them). Used by
benchmarks/kv_cache_dtype.py and tests/test_kv_cache_dtype.py. Torch-free apart from the engine
it is handed.
"""
from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pagedserve.sampling import SamplingParams

# The split of scripts/train_default_model.py (kept equal to its constants of the same names).
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "encodings",
             "pydoc_data", "__pycache__"}
HELD_OUT_EVERY = 20
BOS_ID, EOS_ID = 1, 2


def stdlib_source_files(stdlib_dir: str | Path | None = None) -> list[Path]:
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py"))
            if not any(part in SKIP_DIRS for part in p.relative_to(root).parts[:-1])]


def held_out_files(stdlib_dir: str | Path | None = None) -> list[Path]:
    return [p for i, p in enumerate(stdlib_source_files(stdlib_dir)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]


def held_out_windows(tokenizer, num_windows: int, window_len: int,
                     stdlib_dir: str | Path | None = None) -> list[list[int]]:
    """`num_windows` windows of `window_len` tokens, evenly spaced over the held-out stream
    (<s> file </s> <s> file </s> ..., as training encoded it), not overlapping."""
    stream: list[int] = []
    for path in held_out_files(stdlib_dir):
        text = path.read_text(encoding="utf-8", errors="replace")
        stream += [BOS_ID, *tokenizer.encode(text, add_special_tokens=False, verbose=False), EOS_ID]
    available = len(stream) // window_len
    if available < num_windows:
        raise ValueError(f"the held-out text has {len(stream)} tokens: fewer than {num_windows} x {window_len}")
    stride = available // num_windows
    return [stream[i * stride * window_len:(i * stride + 1) * window_len] for i in range(num_windows)]


@dataclass
class Perplexity:
    nll: float          # summed negative log-likelihood (nats)
    num_tokens: int     # tokens scored

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.num_tokens)


def teacher_forced_perplexity(llm, windows: Sequence[Sequence[int]]) -> Perplexity:
    """Every token after each window's first, scored from the engine's own KV (prompt logprobs)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([list(w) for w in windows], params, use_tqdm=False)
    nll, n = 0.0, 0
    for out in outputs:
        for entry in out.prompt_logprobs[1:]:
            nll -= entry.logprob
            n += 1
    return Perplexity(nll, n)


def greedy_tokens(llm, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([list(p) for p in prompts], params, use_tqdm=False)]


def agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> float:
    """Share of tokens identical to the reference up to each sequence's first divergence."""
    same = total = 0
    for ref, got in zip(reference, other):
        total += len(ref)
        for a, b in zip(ref, got):
            if a != b:
                break
            same += 1
    return same / total if total else 1.0
