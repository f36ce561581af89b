"""Logprob `bytes` are the token's own bytes (a token holding part of a UTF-8 character decodes to
U+FFFD alone), and metrics carry the served model name."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.serving import token_bytes


@pytest.mark.parametrize("text", ["🙂 héllo 日本語", "Ωμέγα 🤖🤖", "plain ascii"])
def test_token_bytes_join_back_into_the_text(tokenizer_dir, text):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == text.encode("utf-8")
    if not text.isascii():  # the case that was wrong: pieces of a character, each "\ufffd" alone
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_served_name_is_what_clients_and_metrics_see():
    assert EngineArgs().served_name() == "SmolLM2-135M-Instruct"  # not the GGUF file's path
    assert EngineArgs(model="/models/x").served_name() == "/models/x"
    assert EngineArgs(model="/models/x", served_model_name="x").served_name() == "x"
