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


def feed_skip(tokenizer, ids, skip_special: bool):
    detok = IncrementalDetokenizer(tokenizer, [], [], False, skip_special)
    visible, shown = [], ""
    for tid in ids:
        detok.add_token(tid)
        shown += detok.take_new_text(finished=False)
        visible.append(shown)
    return visible, shown + detok.take_new_text(finished=True), None


def wordpiece_tokenizer():
    """A WordPiece tokenizer (BERT's kind, where HF's decode cleans up spaces by default), built
    here: its decoder joins the pieces with spaces and the clean-up takes them off again."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[SEP]", "a", "b", "it", "do", "don", "word", "longer", "x", ",", ".", "!", "?", "'", "s",
             "n", "t", "m", "ve", "re", "'s", "n't", "'m", "'ve", "'re", "##s", "##ing", "(", ")"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True), len(words)


def test_streamed_text_is_hfs_decode_where_hf_cleans_up_spaces(tokenizer, tmp_path):
    """Random outputs heavy in the clean-up's patterns (" ,", " .", " ' ", " n't", " 's", ...),
    streamed token by token through a tokenizer whose decode cleans up spaces: the final text
    equals HF's decode of the same ids, and no text shown is retracted (stop strings too). The
    windows used to be cleaned one by one: "a , b" came out "a  b"."""
    import random

    from transformers import AutoTokenizer

    wordpiece, vocab = wordpiece_tokenizer()
    assert wordpiece.decode(wordpiece.convert_tokens_to_ids(["a", ",", "b"])) == "a, b"  # HF does clean up
    make_tokenizer(tmp_path)
    forced = AutoTokenizer.from_pretrained(
        str(tmp_path), clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    rng = random.Random(7)
    punct = forced(" , . ! ? ' n't 's 'm 've 're", add_special_tokens=False).input_ids
    words = forced(" a b x it do word longer", add_special_tokens=False).input_ids
    cases = [(wordpiece, [rng.randrange(2, vocab) for _ in range(rng.randrange(1, 40))]) for _ in range(150)]
    cases += [(forced, [rng.choice(punct if rng.random() < 0.5 else words) for _ in range(rng.randrange(1, 40))])
              for _ in range(150)]
    for tok, ids in cases:
        for skip in (True, False):
            visible, final, _ = feed_skip(tok, ids, skip)
            assert final == tok.decode(ids, skip_special_tokens=skip), (ids, skip)
            assert all(final.startswith(v) for v in visible), (ids, visible)
    ids = wordpiece.convert_tokens_to_ids(["a", ",", "b", "don", "'", "t", "x", ".", "it"])
    text = wordpiece.decode(ids)
    _, final, hit = feed(wordpiece, ids, stop=["x."], prompt=())
    assert hit == "x." and final == text[:text.index("x.")]
    # A stop that only the last held-back text completes (" '" may still become " 's"): found when
    # the output ends, and reported (the output processor makes that finish a stop).
    detok = IncrementalDetokenizer(wordpiece, [], ["b '"], False, True)
    assert [detok.add_token(t) for t in wordpiece.convert_tokens_to_ids(["a", "b", "'"])] == [None] * 3
    assert detok.take_new_text(finished=True) == "a " and detok.flush_stop == "b '"


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
    for skip in (True, False):  # the text streamed token by token is HF's decode of the whole
        visible, final, _ = feed_skip(cleaning, ids, skip)
        assert final == cleaning.decode(ids, skip_special_tokens=skip)
        assert all(final.startswith(v) for v in visible)

    class OwnDecode(type(tokenizer)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "x" * len(token_ids)

    tokenizer.__class__, original = OwnDecode, tokenizer.__class__
    try:
        assert rust_decoder(tokenizer) is None
    finally:
        tokenizer.__class__ = original
