"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes and many fine-tunes):

    some text <tool_call>
    {"name": "f", "arguments": {...}}
    </tool_call><tool_call>{...}</tool_call>

A call runs from `<tool_call>` to the first `</tool_call>` after it. If the JSON between them is
not a call (malformed, no name, arguments not an object), the whole span, tags included, is
content; a `<tool_call>` that never closes is content to the end of the text. `content` is the text
outside the calls, joined and stripped (see base.py).
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedOutput,
    StripFilter,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    call_from_object,
    loads_json,
)
from pagedllm.reasoning.parsers import partial_tag_len

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def _call_from_body(body: str) -> ToolCall | None:
    """The call written between the tags, or None if the text there is not one."""
    try:
        return call_from_object(loads_json(body))
    except ValueError:
        return None


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            end = text.find(CLOSE, start + len(OPEN)) if start >= 0 else -1
            if end < 0:  # no more calls, or one that never closes: the rest is content
                content.append(text[pos:])
                break
            call = _call_from_body(text[start + len(OPEN) : end])
            if call is None:
                content.append(text[pos : end + len(CLOSE)])
            else:
                content.append(text[pos:start])
                calls.append(call)
            pos = end + len(CLOSE)
        return ParsedOutput(content="".join(content).strip() or None, tool_calls=calls)

    def stream(self) -> HermesToolCallStream:
        return HermesToolCallStream()


class HermesToolCallStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # text not yet sent; inside a call, the text after its `<tool_call>`
        self._in_call = False
        self._searched = 0  # inside a call: how far `_buf` holds no CLOSE, so it is not searched again
        self._content = StripFilter()

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += delta
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if not self._in_call:
                start = self._buf.find(OPEN)
                if start < 0:
                    # "...<tool" may be the start of a call: keep it until the next delta says
                    send = len(self._buf) - partial_tag_len(self._buf, OPEN)
                    content.append(self._buf[:send])
                    self._buf = self._buf[send:]
                    break
                content.append(self._buf[:start])
                self._buf = self._buf[start + len(OPEN) :]
                self._in_call, self._searched = True, 0
            else:
                end = self._buf.find(CLOSE, self._searched)
                if end < 0:
                    # the tag may have begun near the end: search those characters again next time
                    self._searched = max(0, len(self._buf) - len(CLOSE) + 1)
                    break
                call = _call_from_body(self._buf[:end])
                if call is None:
                    content.append(OPEN + self._buf[: end + len(CLOSE)])
                else:
                    deltas.extend(self._emit(call))
                self._buf = self._buf[end + len(CLOSE) :]
                self._in_call = False
        return self._content.feed("".join(content)), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        # An unclosed call is content, and so is a held piece that never became a tag.
        rest = (OPEN if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        out = self._content.feed(rest)
        self._content.finish()
        return out, []
