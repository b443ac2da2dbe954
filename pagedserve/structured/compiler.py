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

A matcher that fails (llguidance reports grammar and resource-limit errors, e.g. an Earley
row over `max_items_in_row`, by entering an error state, never by raising) never goes on
unconstrained: `error` holds the message, its mask allows only EOS, and the runner reports
the request as failed (core/outputs.py StepResult.errors) so the client gets an error.
What can be caught before generation is caught at compile time: a choice list is one
lexeme (no row limit applies to it), and every compiled grammar takes one probe step (the
first allowed token) so a grammar whose very first row is too large is a 400.
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
DEFAULT_CACHE_BYTES = 64 << 20
# llguidance exposes no size of a compiled matcher; an entry is estimated as a fixed part plus a
# part per character of its grammar text. Measured (RSS growth over 200 distinct JSON schemas,
# each compiled and masked once, built-in model): ~150 KiB fixed, ~90 B per grammar character.
ENTRY_BASE_BYTES = 150 << 10
ENTRY_BYTES_PER_CHAR = 90
# Short errors: the verbose form appends the whole grammar and parser state (megabytes for a
# large grammar) to every message, log line and client error.
_LIMITS_KW = {"verbose_errors": False}


def _message(error: str) -> str:
    """llguidance's error text without its trailing non-verbose marker."""
    return error.replace("<non-verbose/>", "").strip()


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
        self.error: str | None = None  # set once the matcher failed; it never recovers

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
            if self.error is not None:
                return  # a failed matcher cannot roll back out of its error; the request is failing
            self._matcher.rollback(len(consumed) - common)
            del consumed[common:]
        for token in token_ids[start + common:end]:
            self.accept(token)

    def accept(self, token: int) -> None:
        """Advance by a sampled token. The sampler only draws tokens the mask allows, so a
        rejection is the grammar library failing (a resource limit, an internal error): it is
        recorded in `error` and the request must end with an error, never go on unconstrained."""
        self.consumed.append(token)
        if self.error is not None or self._matcher.is_stopped():
            return  # failed (reported already), or finished: only EOS may follow and ends the request
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            self.error = _message(self._matcher.get_error()) or f"the grammar rejected token {token}"
            logger.warning("grammar matcher failed at token %d (output token %d): %s", token,
                           len(self.consumed), self.error)

    @property
    def is_error(self) -> bool:
        return self.failure() is not None

    def failure(self) -> str | None:
        """Why this matcher cannot go on (None while it is fine)."""
        if self.error is None and self._matcher.is_error():
            self.error = _message(self._matcher.get_error()) or "the grammar matcher failed"
        return self.error

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens as a bitmask (bit i of word i // 32 = token i) into
        `row`, a contiguous int32 array of ceil(vocab / 32) words. A failed matcher (before or
        while computing this mask) allows only EOS: whatever is drawn is discarded, as the
        request ends with its error."""
        if self.failure() is None and not self._matcher.is_stopped():
            self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if self.failure() is None:
                return
        words = row.view(np.uint32)
        words[:] = 0
        for t in self._eos_token_ids:
            words[t // 32] |= np.uint32(1 << (t % 32))


class CompiledGrammar:
    """A compiled grammar; matchers for requests are copies of this one (never advanced)."""

    def __init__(self, matcher, eos_token_ids: list[int], estimated_bytes: int = 0) -> None:
        self._template = matcher
        self._eos_token_ids = eos_token_ids
        self.estimated_bytes = estimated_bytes  # what it counts against the cache's byte bound

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self._eos_token_ids)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary; thread-safe.

    The cache is an LRU bounded both by entries (`cache_size`) and by estimated bytes
    (`cache_bytes`, see ENTRY_BASE_BYTES): a stream of large distinct schemas cannot grow
    memory past the byte bound, and a grammar estimated over the whole bound is compiled
    and used but not kept."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self.num_compiled = 0  # compilations done (cache misses), for tests and logs

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    @property
    def cache_num_entries(self) -> int:
        return len(self._cache)

    @property
    def cache_num_bytes(self) -> int:
        """Estimated bytes of the cached compiled grammars."""
        return self._cached_bytes

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
                schema = params.schema()
                if kind == "json" and params.disable_additional_properties:
                    schema = close_objects(schema)
                return matcher_cls.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
            if kind == "regex":
                return matcher_cls.grammar_from_regex(params.regex)
            if kind == "choice":
                return choice_grammar(params.choice)
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
            self.num_compiled += 1
            if key in self._cache or compiled.estimated_bytes > self.cache_bytes:
                return self._cache.get(key, compiled)  # compiled twice at once / too big to keep
            self._cache[key] = compiled
            self._cached_bytes += compiled.estimated_bytes
            while len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes:
                _, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.estimated_bytes
        return compiled

    def _compile(self, params: StructuredOutputsParams, ll_tokenizer) -> CompiledGrammar:
        llg = _llguidance()
        grammar = self.grammar_text(params)
        what = f"{params.field}: invalid {params.kind.replace('_', ' ')}"
        limits = llg.LLParserLimits(**_LIMITS_KW)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer, limits=limits)
        if is_error:
            raise ValueError(f"{what}: {_message(messages[0])}")
        matcher = llg.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise ValueError(f"{what}: {_message(matcher.get_error())}")
        self._probe(matcher, params)
        estimated = ENTRY_BASE_BYTES + ENTRY_BYTES_PER_CHAR * len(grammar)
        return CompiledGrammar(matcher, self.eos_token_ids, estimated)

    def _probe(self, matcher, params: StructuredOutputsParams) -> None:
        """Take one step on a copy: the first token the grammar allows. llguidance builds a
        parser row only when a token is consumed, so a grammar whose first row is over the
        library's limits (an alternation of >= 2000 items) compiles cleanly and fails at the
        first generated token; this finds it now, as a 400 naming the field. Limits that a
        later row trips are caught during generation (the request then ends with an error)."""
        row = np.zeros(self.bitmask_words, dtype=np.int32)
        probe = matcher.deep_copy()
        probe.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if not probe.is_error():
            words = row.view(np.uint32)
            eos = set(self.eos_token_ids)
            allowed = (int(w) * 32 + b for w in np.flatnonzero(words) for b in range(32) if (int(words[w]) >> b) & 1)
            token = next((t for t in allowed if t not in eos and t < self.vocab_size), None)
            if token is None:
                return  # only EOS (an empty language or a finished one): nothing to probe
            probe.consume_token(token)
        if probe.is_error():
            raise ValueError(f"{params.field}: the {params.kind.replace('_', ' ')} is too complex for the grammar "
                             f"engine: {_message(probe.get_error())}")

    def new_matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        return self.compile(params).new_matcher()


def choice_grammar(choices) -> str:
    """One terminal (a lexeme) whose alternatives are the choices: the lexer matches it as
    one regular language, so no parser row holds an item per choice and the library's
    row limit (2000 items) cannot trip however long the list. A rule `start: "a" | "b" ...`
    compiles too, but fails at the first token from 2000 choices on."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)


# Keys whose values are data (or annotations), never subschemas, in a JSON schema.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "example", "required", "title", "description",
                        "$comment", "format", "pattern", "type", "$ref", "$id", "$schema", "$anchor"})
# Keys whose values map names to subschemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# An object schema saying any of these has decided what other keys may appear.
_EXTRA_KEY_RULES = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def close_objects(schema, _in_all_of: bool = False):
    """A copy of `schema` where every object schema that lists `properties` and says nothing
    about other keys gets `additionalProperties: false` (what vLLM's default xgrammar backend
    does, and what OpenAI's strict mode requires). JSON Schema's own default is open: a model
    may then invent keys until max_tokens. An object with no `properties` (e.g. json_object's
    {"type": "object"}) stays open, as do allOf members (closing each would reject the keys
    the others add) and any schema that sets additionalProperties itself."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: close_objects(sub) for name, sub in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [close_objects(sub, _in_all_of=True) for sub in value]
        else:
            out[key] = close_objects(value)
    if (isinstance(schema.get("properties"), dict) and not _in_all_of
            and not any(k in schema for k in _EXTRA_KEY_RULES)):
        out["additionalProperties"] = False
    return out


def make_grammar_compiler(tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                          cache_bytes: int = DEFAULT_CACHE_BYTES):
    """Structured outputs compile against the tokenizer's vocabulary: none without one."""
    if tokenizer is None:
        return None
    return GrammarCompiler(tokenizer, vocab_size, eos_token_ids, cache_bytes=cache_bytes)
