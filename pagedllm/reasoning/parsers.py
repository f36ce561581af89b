"""Reasoning parsers: a thinking model's output split into `reasoning_content` and `content`, as
vLLM's `--reasoning-parser NAME` does.

Both formats wrap the reasoning in `<think>` ... `</think>`; they differ in where `<think>` is:
- deepseek_r1: the chat template opens `<think>` in the prompt, so the output is reasoning from its
  first character (a `<think>` at the very start of the output, if the model writes one anyway, is
  dropped) up to `</think>`, then content. Without `</think>` it is all reasoning.
- qwen3: the output itself opens `<think>` (leading whitespace before it is dropped). An output
  that does not start so is all content (thinking switched off); a `<think>` that never closes
  makes the rest reasoning.

Whitespace rule, the same for both: the reasoning has its leading and trailing newlines ("\\n")
stripped (the models write "<think>\\n...\\n</think>"); the content after `</think>` has its leading
newlines stripped (the "\\n\\n" the models write after `</think>`), its end is left alone; content
from an output with no thinking at all (qwen3) is returned unchanged. An empty part is None.

Streams return the same parts in pieces: joined, each equals `parse()`'s (with "" for None).
Tags cut across deltas ("</thi" + "nk>") are held back until the next delta tells.
"""

from __future__ import annotations

OPEN = "<think>"
CLOSE = "</think>"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (0 if none): the part a
    stream must hold back, since the next delta may complete the tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """Fed one choice's text as it is generated, split anywhere."""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning text to send now, content text to send now)."""
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        """At the end of generation: flush what was held back."""
        raise NotImplementedError


class ReasoningParser:
    """One model family's thinking format. Stateless; `stream()` makes the per-choice state."""

    name: str = ""

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content); None for an empty part."""
        raise NotImplementedError

    def stream(self) -> ReasoningStream:
        raise NotImplementedError


def _split_thinking(body: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of the text that follows an opened `<think>`."""
    end = body.find(CLOSE)
    if end < 0:
        return body.strip("\n") or None, None
    return body[:end].strip("\n") or None, body[end + len(CLOSE) :].lstrip("\n") or None


class _NewlineStrip:
    """Streams text so that what it returns joins to the whole text `.strip("\\n")`: leading
    newlines are dropped, trailing ones held until more text follows (dropped at the end)."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip("\n")
            self._started = bool(text)
        text = self._held + text
        out = text.rstrip("\n")
        self._held = text[len(out) :]
        return out


class _ThinkStream(ReasoningStream):
    """Both formats' stream: they differ only in how the output's start is read."""

    def __init__(self, space_before_open: bool, open_required: bool) -> None:
        self._space_before_open = space_before_open  # qwen3: "\n<think>" still opens
        self._open_required = open_required  # qwen3: no <think>, no reasoning at all
        self._phase = "start"  # then "reasoning", then "content"
        self._buf = ""  # text held back: the output's start, or a possible piece of </think>
        self._reasoning = _NewlineStrip()
        self._strip_content = False  # drop the content's leading newlines (after </think>)

    def feed(self, delta: str) -> tuple[str, str]:
        reasoning = content = ""
        if self._phase == "start":
            self._buf += delta
            head = self._buf.lstrip() if self._space_before_open else self._buf
            if len(head) < len(OPEN) and OPEN.startswith(head):
                return "", ""  # may still be <think>
            if head.startswith(OPEN):
                self._phase, delta = "reasoning", head[len(OPEN) :]
            else:
                self._phase = "content" if self._open_required else "reasoning"
                delta = self._buf
            self._buf = ""
        if self._phase == "reasoning":
            text = self._buf + delta
            end = text.find(CLOSE)
            if end < 0:
                keep = partial_tag_len(text, CLOSE)
                self._buf = text[len(text) - keep :]
                return self._reasoning.feed(text[: len(text) - keep]), ""
            reasoning = self._reasoning.feed(text[:end])  # its held trailing newlines are dropped
            self._phase, self._buf, self._strip_content = "content", "", True
            delta = text[end + len(CLOSE) :]
        if self._strip_content:
            delta = delta.lstrip("\n")
            self._strip_content = not delta
        content = delta
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._phase == "start" and self._open_required:
            return "", rest  # qwen3: never opened <think>, so it is all content
        if self._phase == "content":
            return "", ""
        # deepseek_r1's unopened start, or a held piece that never became </think>: reasoning
        return self._reasoning.feed(rest), ""


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def parse(self, text: str) -> tuple[str | None, str | None]:
        return _split_thinking(text[len(OPEN) :] if text.startswith(OPEN) else text)

    def stream(self) -> ReasoningStream:
        return _ThinkStream(space_before_open=False, open_required=False)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def parse(self, text: str) -> tuple[str | None, str | None]:
        head = text.lstrip()
        if not head.startswith(OPEN):
            return None, text or None
        return _split_thinking(head[len(OPEN) :])

    def stream(self) -> ReasoningStream:
        return _ThinkStream(space_before_open=True, open_required=True)
