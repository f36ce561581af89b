"""Incremental detokenization: multi-byte characters and stop strings that span tokens."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedllm.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("text", ["héllo wörld, naïve café", "数学 和 日本語のテキスト", "emoji 🎉🚀 and 👩‍👩‍👧 family",
                                  "  leading spaces\n\ttabs and\r\nnewlines  "])
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
