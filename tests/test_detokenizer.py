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


def test_one_tokenizer_serves_several_threads_at_once(tokenizer):
    """The engine shares one fast tokenizer between the event loop, the tokenize pool and the
    engine thread: the calls it makes (encode, decode, the chat template), each in two threads at
    once, give what each gives alone. (A call with truncation=True is not safe beside them: it
    sets the Rust tokenizer's truncation while others encode, and some of either come out wrong.
    The engine makes none, and each of its threads has its own copy: the next test.)"""
    import threading

    text = "héllo wörld, the same words again and again " * 40
    ids = tokenizer.encode(text)
    chat = [{"role": "user", "content": text[:300]}]
    calls = {
        "encode": lambda: tokenizer.encode(text),
        "decode": lambda: tokenizer.decode(ids),
        "chat": lambda: tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
    }
    alone = {name: call() for name, call in calls.items()}
    results: list[tuple[str, object]] = []

    def hammer(name: str) -> None:
        for _ in range(100):
            try:
                results.append((name, calls[name]()))
            except Exception as e:  # noqa: BLE001 - what a thread met is the result
                results.append((name, e))

    threads = [threading.Thread(target=hammer, args=(name,)) for name in [*calls, *calls]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 600
    assert all(result == alone[name] for name, result in results), [r for r in results if r[1] != alone[r[0]]][:3]


def _hammer(calls: dict, rounds: int) -> list[tuple[str, object]]:
    """Each call in a thread of its own, `rounds` times, all at once: what each call gave."""
    import threading

    results: list[tuple[str, object]] = []
    start = threading.Barrier(len(calls))

    def hammer(name: str) -> None:
        start.wait()
        for _ in range(rounds):
            try:
                results.append((name, calls[name]()))
            except Exception as e:  # noqa: BLE001 - what a thread met is the result
                results.append((name, e))

    threads = [threading.Thread(target=hammer, args=(name,)) for name in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_each_thread_gets_its_own_tokenizer_copy(tokenizer):
    """PerThreadTokenizer: even a call that changes the tokenizer's settings (truncation) beside
    plain encodes in other threads leaves every result what it is alone. (On one shared tokenizer
    this mix comes out wrong or raises "Already borrowed".)"""
    from pagedllm.tokenizer import PerThreadTokenizer

    per_thread = PerThreadTokenizer(tokenizer)
    text = "héllo wörld, the same words again and again " * 40
    calls = {
        "encode": lambda: per_thread.get().encode(text),
        "encode2": lambda: per_thread.get().encode(text),
        "truncated": lambda: per_thread.get().encode(text, truncation=True, max_length=16),
        "decode": lambda: per_thread.get().decode(tokenizer.encode(text)[:50]),
    }
    alone = {name: call() for name, call in calls.items()}
    results = _hammer(calls, 150)
    assert len(results) == 600
    assert all(result == alone[name] for name, result in results), [r for r in results if r[1] != alone[r[0]]][:3]
    # The same copy for a thread's every call; another thread's is another object.
    import threading

    mine, theirs = per_thread.get(), []
    thread = threading.Thread(target=lambda: theirs.append(per_thread.get()))
    thread.start()
    thread.join()
    assert per_thread.get() is mine and theirs[0] is not mine and mine is not tokenizer
