"""Incremental detokenization and stop-string matching for one sequence.

Decoding the whole output every step is quadratic; instead, as vLLM does, only a short
window of tokens is decoded, and text is taken once it no longer ends in a partial UTF-8
character. Text is released to the caller in order and never retracted: while a stop
string could still begin in the newest characters (the last longest-stop-string - 1 of
them), those are held back. The work per token is bounded by the window and the stop
strings' lengths, never by the length of the output.
"""
from __future__ import annotations

import sys

from pagedserve.core.stop import past_min_tokens

_INCOMPLETE = "\ufffd"
_CONTEXT_TOKENS = 6  # prompt tokens decoded before the output, so a leading space decodes right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], include_stop: bool,
                 skip_special_tokens: bool, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
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

    def _decode(self, ids: list[int]) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(ids, self.skip_special)
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
