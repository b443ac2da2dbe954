"""Incremental detokenization and stop-string matching for one sample.

Decoding the whole output every step is quadratic; instead, as vLLM does, only a short
window of tokens is decoded, and text is emitted once it no longer ends in a partial
UTF-8 character. While unfinished, the text handed out holds back the last
(longest stop string - 1) characters so that text once streamed never has to be retracted.
"""
from __future__ import annotations

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop: bool, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.holdback = 0 if include_stop or not stop else max(len(s) for s in stop) - 1
        self.text = ""
        self.tokens: list[int] = list(prompt_token_ids[-6:])  # context so leading spaces decode right
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token_id: int) -> str | None:
        """Append a token; return the matched stop string if the text now contains one."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if full.endswith(_INCOMPLETE) or len(full) <= len(prefix):
            return None  # a partial character: wait for the next token
        new_text = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        search_from = max(len(self.text) - (max((len(s) for s in self.stop), default=1) - 1), 0)
        self.text += new_text
        return self._find_stop(search_from)

    def _find_stop(self, search_from: int) -> str | None:
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return s

    def visible_text(self, finished: bool) -> str:
        if finished or not self.holdback:
            return self.text
        return self.text[: max(len(self.text) - self.holdback, 0)]
