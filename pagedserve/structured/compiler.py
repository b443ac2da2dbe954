"""Grammar compilation (llguidance) and the per-request matcher the sampler masks with.

    GrammarCompiler.compile(params)   on the server's tokenizer thread (or add_request's caller):
                                      checks and compiles the grammar once per distinct spec,
                                      keeping the result in a bounded LRU cache (thread-safe).
    GrammarCompiler.new_matcher(...)  in the executor: a fresh matcher, a cheap copy of the
                                      cached compiled one (compiled here only on a cache miss).
    GrammarMatcher                    one request's parse state; `sync` makes it match the
                                      output tokens fed so far, `fill_bitmask` writes the
                                      allowed next tokens, `accept` advances it.

Invariant: when a request samples, its matcher has consumed exactly its output tokens fed
so far. The runner calls `sync` before each mask, so whatever happened in between (a
recompute preemption re-feeding the same outputs, a future executor that discards tokens)
the matcher rolls back to the common prefix and replays the rest: it is never ahead of,
nor behind, the text.
"""
from __future__ import annotations

import collections
import json
import logging
import threading
from copy import copy

import numpy as np

from pagedserve.structured.params import StructuredOutputsParams

logger = logging.getLogger("pagedserve.structured")

# JSON text as llguidance writes it under a schema: one fixed separator style and no
# free whitespace. Free whitespace lets a weak model pad forever and never close the object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_SIZE = 256


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ValueError(f"structured_outputs: the llguidance package is not installed ({e})") from None
    return llguidance


class GrammarMatcher:
    """One request's grammar state (an llguidance LLMatcher) and the tokens it consumed."""

    def __init__(self, matcher, eos_token_ids: list[int]) -> None:
        self._matcher = matcher
        self._eos_token_ids = eos_token_ids
        self.consumed: list[int] = []

    @property
    def ll_matcher(self):
        return self._matcher

    def sync(self, token_ids: list[int], start: int, end: int) -> None:
        """Make the consumed tokens equal token_ids[start:end] (the output tokens fed so far):
        roll back to the common prefix, then consume the rest."""
        n = end - start
        consumed = self.consumed
        if len(consumed) == n and (n == 0 or consumed[-1] == token_ids[end - 1]):
            return  # the usual case: nothing happened since the last accept
        common = 0
        limit = min(len(consumed), n)
        while common < limit and consumed[common] == token_ids[start + common]:
            common += 1
        if common < len(consumed):
            self._matcher.rollback(len(consumed) - common)
            del consumed[common:]
        for token in token_ids[start + common:end]:
            self.accept(token)

    def accept(self, token: int) -> None:
        """Advance by a sampled token. A token the grammar cannot take (only possible when
        the caller's own rules, e.g. min_tokens, outvoted the mask) is logged and recorded,
        and the matcher stops constraining."""
        self.consumed.append(token)
        if self._matcher.is_stopped():
            return  # finished: only EOS may follow, and the request ends on it
        if not self._matcher.consume_token(token):
            logger.warning("grammar matcher rejected token %d: %s", token, self._matcher.get_error())

    @property
    def is_error(self) -> bool:
        return self._matcher.is_error()

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens as a bitmask (bit i of word i // 32 = token i) into
        `row`, a contiguous int32 array of ceil(vocab / 32) words."""
        if self._matcher.is_stopped():
            words = row.view(np.uint32)
            words[:] = 0
            for t in self._eos_token_ids:
                words[t // 32] |= np.uint32(1 << (t % 32))
            return
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)


class CompiledGrammar:
    """A compiled grammar; matchers for requests are copies of this one (never advanced)."""

    def __init__(self, matcher, eos_token_ids: list[int]) -> None:
        self._template = matcher
        self._eos_token_ids = eos_token_ids

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self._eos_token_ids)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary; thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self.num_compiled = 0  # compilations done (cache misses), for tests and logs

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def ll_tokenizer(self):
        """llguidance's view of the vocabulary, built once (it reads the tokenizer's JSON)."""
        if self._ll_tokenizer is None:
            llg = _llguidance()
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise ValueError("structured_outputs: needs a fast (Hugging Face tokenizers) tokenizer")
            backend = copy(backend)
            backend.no_padding()
            backend.no_truncation()
            eos = self.eos_token_ids or None
            self._ll_tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        return self._ll_tokenizer

    def grammar_text(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar for a spec (cheap; checked by compiling it)."""
        llg = _llguidance()
        matcher_cls = llg.LLMatcher
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                return matcher_cls.grammar_from_json_schema(json.dumps(params.schema()), overrides=JSON_OPTIONS)
            if kind == "regex":
                return matcher_cls.grammar_from_regex(params.regex)
            if kind == "choice":
                return matcher_cls.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
            return llg.grammar_from("grammar", params.grammar)
        except ValueError as e:
            raise ValueError(f"{params.field}: {e}") from None

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar for `params`, from the cache or compiled now. Raises one
        ValueError naming params.field when the schema / regex / grammar is invalid."""
        key = params.cache_key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            ll_tokenizer = self.ll_tokenizer()
        compiled = self._compile(params, ll_tokenizer)  # outside the lock: llguidance drops the GIL
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return compiled

    def _compile(self, params: StructuredOutputsParams, ll_tokenizer) -> CompiledGrammar:
        llg = _llguidance()
        grammar = self.grammar_text(params)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
        if is_error:
            raise ValueError(f"{params.field}: invalid {params.kind.replace('_', ' ')}: {messages[0].strip()}")
        matcher = llg.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{params.field}: invalid {params.kind.replace('_', ' ')}: {matcher.get_error()}")
        return CompiledGrammar(matcher, self.eos_token_ids)

    def new_matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        return self.compile(params).new_matcher()


def make_grammar_compiler(tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
    """Structured outputs compile against the tokenizer's vocabulary: none without one."""
    if tokenizer is None:
        return None
    return GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
