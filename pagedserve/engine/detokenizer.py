"""Incremental detokenization and stop-string matching for one sequence.

Decoding the whole output every step is quadratic; instead, as vLLM does, only a short
window of tokens is decoded, and text is taken once it no longer ends in a partial UTF-8
character. Text is released to the caller in order and never retracted: while a stop
string could still begin in the newest characters (the last longest-stop-string - 1 of
them), those are held back. The work per token is bounded by the window and the stop
strings' lengths, never by the length of the output.

Tokenizers whose decode cleans up spaces (`clean_up_tokenization_spaces`, which HF applies to
non-BPE tokenizers: " ," -> ",", " n't" -> "n't", ...): the windows are decoded raw and the
clean-up runs on the raw text released so far, cut only where it cannot change later (no space
in the 4 characters before the cut: every clean-up pattern starts with a space and is at most 4
long, and each only deletes spaces). Cleaning each window instead drops characters ("a , b" came
out "a  b"); the text is now HF's decode of the output, token for token.
"""
from __future__ import annotations

import sys

from pagedserve.core.stop import past_min_tokens

_INCOMPLETE = "\ufffd"
_CONTEXT_TOKENS = 6  # prompt tokens decoded before the output, so a leading space decodes right
_CLEANUP_REACH = 4   # the longest clean-up pattern (" n't", " 're", " 've"); each starts with a space


def applies_cleanup(tokenizer) -> bool:
    """Whether HF's decode of this tokenizer cleans up tokenization spaces (transformers 5
    skips it for BPE models unless forced)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        return bool(getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                            False))
    return True


# HF's clean_up_tokenization, in its order: each pattern starts with a space and only deletes spaces.
_CLEANUP_PATTERNS = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")


class _SpaceCleanup:
    """HF's clean_up_tokenization over a growing raw text, released in pieces whose clean-ups
    join to the clean-up of the whole: a piece ends only where no text after a space in its
    last 4 characters could still grow into a pattern (a proper prefix of one), so no pattern
    straddles the cut, at any stage of the clean-up (each only deletes spaces)."""

    def __init__(self, clean) -> None:
        self.clean = clean
        self.raw = ""

    def feed(self, text: str, final: bool = False) -> str:
        raw = self.raw + text
        cut = len(raw)
        while not final and cut > 0:
            unsafe = [s for s in range(max(0, cut - _CLEANUP_REACH), cut) if raw[s] == " " and any(
                p.startswith(raw[s:cut]) and p != raw[s:cut] for p in _CLEANUP_PATTERNS)]
            if not unsafe:
                break
            cut = unsafe[0]
        self.raw = raw[cut:]
        return self.clean(raw[:cut]) if cut else ""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], include_stop: bool,
                 skip_special_tokens: bool, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self._cleanup = _SpaceCleanup(tokenizer.clean_up_tokenization) if applies_cleanup(tokenizer) else None
        self._rust_decode = rust_decoder(tokenizer)
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.min_tokens = min_tokens
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.holdback = 0 if not stop else self.max_stop_len - 1
        self.num_output_tokens = 0
        self._tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._released: list[str] = []   # text handed out, in pieces (joined only at the end)
        self._pending = ""               # text decoded but held back for stop matching
        self.stopped = False
        self.flush_stop: str | None = None  # a stop string found only in the clean-up's last text, at the end

    def _decode(self, ids: list[int]) -> str:
        """A window's raw text (any clean-up runs on the released text, _SpaceCleanup)."""
        if self._rust_decode is not None:
            return self._rust_decode(ids, self.skip_special)
        if self._cleanup is not None:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token_id: int) -> str | None:
        """Append one output token; return the stop string it completed, if any (the text
        then ends before it, or after it with include_stop_str_in_output)."""
        self.num_output_tokens += 1
        self._tokens.append(token_id)
        prefix = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset:])
        if full.endswith(_INCOMPLETE) or len(full) <= len(prefix):
            return None  # a partial character: wait for the next token
        new_text = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        if self._cleanup is not None:
            new_text = self._cleanup.feed(new_text)
            if not new_text:
                return None
        self._pending += new_text
        if self.stop and past_min_tokens(self.num_output_tokens, self.min_tokens):
            hit = self._match_stop(len(new_text))
            if hit is not None:
                return hit
        return None

    def _match_stop(self, num_new_chars: int) -> str | None:
        """The earliest stop string that ends in the newest characters."""
        pending = self._pending
        best = None
        for s in self.stop:
            i = pending.find(s, max(len(pending) - num_new_chars - len(s) + 1, 0))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self._pending = pending[: i + len(s)] if self.include_stop else pending[:i]
        self.stopped = True
        return s

    def take_new_text(self, finished: bool) -> str:
        """Text not handed out before: all of it when finished, else all but the holdback."""
        if finished and self._cleanup is not None and not self.stopped and self._cleanup.raw:
            tail = self._cleanup.feed("", final=True)
            self._pending += tail
            if self.stop and past_min_tokens(self.num_output_tokens, self.min_tokens):
                self.flush_stop = self._match_stop(len(tail))
        if finished or self.stopped or not self.holdback:
            out, self._pending = self._pending, ""
        else:
            cut = max(len(self._pending) - self.holdback, 0)
            out, self._pending = self._pending[:cut], self._pending[cut:]
        if out:
            self._released.append(out)
        return out

    @property
    def text(self) -> str:
        """Everything released so far (O(length): for final outputs only)."""
        return "".join(self._released)


def rust_decoder(tokenizer):
    """`tokenizer.decode(ids, skip_special_tokens=s)` as one call into its Rust tokenizer, or
    None. Only where that is all HF's decode would run: a TokenizersBackend whose decode and
    _decode are HF's own, without clean_up_tokenization_spaces (HF then returns the Rust
    decode's text as it is). HF's decode first copies the ids through `to_py_obj` (an
    isinstance per id, in Python), twice a token."""
    module = sys.modules.get("transformers.tokenization_utils_tokenizers")
    base = sys.modules.get("transformers.tokenization_utils_base")
    if module is None or base is None:
        return None
    backend = getattr(module, "TokenizersBackend", None)
    cls = type(tokenizer)
    if (backend is None or not isinstance(tokenizer, backend)
            or cls.decode is not base.PreTrainedTokenizerBase.decode or cls._decode is not backend._decode
            or tokenizer.clean_up_tokenization_spaces):
        return None
    rust = getattr(tokenizer, "_tokenizer", None)
    return getattr(rust, "decode", None)
