"""The incremental detokenizer, fed one byte-level token at a time.

The tiny tokenizer has no merges for non-ASCII text, so every multi-byte character arrives
as 2-4 tokens of one byte each: exactly the case where decoding a prefix yields U+FFFD.
The reference is the tokenizer's own full `decode` of the same ids.
"""
from __future__ import annotations

import pytest

from checkpoints import make_tokenizer
from pagedserve.engine.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
TEXTS = ["é✓😀", "def f(x): return 'é✓😀' + x", "中文字符和日本語のテキスト", "ab 中文 é✓ 😀😀 cd"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def feed(tokenizer, ids, stop=(), include_stop=False, prompt=(5, 6)):
    """Feed ids one at a time; return (visible text after each token, final text, stop hit)."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), list(stop), include_stop, True)
    visible, shown, hit = [], "", None
    for tid in ids:
        hit = detok.add_token(tid)
        shown += detok.take_new_text(finished=hit is not None)
        visible.append(shown)
        if hit is not None:
            break
    return visible, shown + detok.take_new_text(finished=True), hit


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokens_never_show_a_partial_character(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if any(ord(c) > 127 for c in text):  # the case under test: characters split over tokens
        assert any(REPLACEMENT in tokenizer.decode([t]) for t in ids)
    visible, final, hit = feed(tokenizer, ids)
    assert hit is None
    assert final == tokenizer.decode(ids) == text
    for k, shown in enumerate(visible):
        assert REPLACEMENT not in shown, (k, shown)
        # all that is decodable so far, and nothing more: the full decode minus its partial tail
        assert shown == tokenizer.decode(ids[:k + 1]).rstrip(REPLACEMENT), k
    for a, b in zip(visible, visible[1:]):
        assert b.startswith(a)  # text once shown is never retracted


@pytest.mark.parametrize("text,stop", [
    ("ab é✓😀 cd", "é✓"),        # the stop starts and ends inside multi-token characters
    ("ab é✓😀 cd", "✓😀"),
    ("中文字符和日本語", "字符"),
    ("x 😀😀 y", "😀 "),          # its last character is ASCII; its first arrives in 4 pieces
])
@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_string_made_of_split_characters(tokenizer, text, stop, include_stop):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    at = text.index(stop)
    visible, final, hit = feed(tokenizer, ids, stop=[stop], include_stop=include_stop)
    assert hit == stop
    assert final == text[: at + len(stop)] if include_stop else final == text[:at]
    # the hit comes with the token that completes the stop's last character, not later
    assert len(visible) == next(k + 1 for k in range(len(ids)) if stop in tokenizer.decode(ids[:k + 1]))
    for shown in visible:
        assert REPLACEMENT not in shown and final.startswith(shown)


def test_first_matching_stop_wins_and_nothing_is_retracted(tokenizer):
    text = "中文字符和日本語のテキスト"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    visible, final, hit = feed(tokenizer, ids, stop=["日本語の", "字符"])
    assert hit == "字符" and final == "中文"
    assert all(final.startswith(v) for v in visible)  # held-back text covered the longer stop too


def test_rust_decode_only_where_hf_decode_adds_nothing(tokenizer, tmp_path):
    """The detokenizer calls the Rust tokenizer directly only where HF's decode would return
    its text unchanged; where HF cleans the text up (or a class decodes its own way) the text
    is HF's. The reference: the tokenizer's own decode of the same ids."""
    from transformers import AutoTokenizer

    from pagedserve.engine.detokenizer import rust_decoder

    assert rust_decoder(tokenizer) is not None  # the plain fast tokenizer: the direct path
    text = "a , b . c ! d ?"
    ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    for skip in (True, False):
        assert rust_decoder(tokenizer)(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    make_tokenizer(tmp_path)
    cleaning = AutoTokenizer.from_pretrained(
        str(tmp_path), clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    assert cleaning.decode(ids) != tokenizer.decode(ids)  # the case matters: HF changes the text here
    assert rust_decoder(cleaning) is None
    for skip in (True, False):  # each window the detokenizer decodes reads as HF decodes it
        assert IncrementalDetokenizer(cleaning, [], [], False, skip)._decode(ids) == cleaning.decode(
            ids, skip_special_tokens=skip)

    class OwnDecode(type(tokenizer)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "x" * len(token_ids)

    tokenizer.__class__, original = OwnDecode, tokenizer.__class__
    try:
        assert rust_decoder(tokenizer) is None
    finally:
        tokenizer.__class__ = original
