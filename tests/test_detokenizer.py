"""Incremental detokenization: multi-byte characters and stop strings that span tokens."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedllm.engine.detokenizer import IncrementalDetokenizer, _decoder


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld, naïve café",
        "数学 和 日本語のテキスト",
        "emoji 🎉🚀 and 👩‍👩‍👧 family",
        "  leading spaces\n\ttabs and\r\nnewlines  ",
    ],
)
def test_streamed_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt, [], False, True)
    for token in ids:
        detok.update(token)
        assert "\ufffd" not in detok.text  # half a character is never shown
        assert tokenizer.decode(ids).startswith(detok.text)
    assert detok.text == tokenizer.decode(ids)


def test_stop_string_spanning_tokens(tokenizer):
    ids = tokenizer.encode("Hello world, this is a test")
    stop = "o wor"
    assert not any(stop in tokenizer.decode([t]) for t in ids)  # it really spans tokens
    detok = IncrementalDetokenizer(tokenizer, [], [stop], False, True)
    found = None
    for token in ids:
        found = detok.update(token)
        assert stop not in detok.visible_text(False)
        if found:
            break
    assert found == stop and detok.text == "Hell"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_fast_decode_gives_the_tokenizers_answer(tokenizer, skip_special_tokens):
    ids = tokenizer.encode("Ünïcode, spaces  and\nlines") + tokenizer.all_special_ids + tokenizer.encode(" end")
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert _decoder(tokenizer)(ids, skip_special_tokens) == expected


def test_tokenizers_that_clean_up_spaces_decode_through_transformers(tokenizer):
    class CleaningUp:  # what the wrapper would do differently: the Rust tokenizer must not be used
        _tokenizer = tokenizer._tokenizer
        clean_up_tokenization_spaces = True

        def decode(self, ids, skip_special_tokens):
            return "cleaned"

    assert _decoder(CleaningUp())([5, 6], True) == "cleaned"
