"""Llama 3.1/3.2 JSON tool calling: the whole output is one or more calls

    <|python_tag|>{"name": "f", "parameters": {...}}; {"name": "g", "arguments": {...}}

The python tag is optional, calls are separated by `;` (whitespace allowed around it, and a `;`
after the last call is tolerated), and "arguments" may stand for "parameters". It is all or
nothing: an output (stripped) that does not start with `{` or the tag, or that starts so but is not
wholly calls, is all content; when calls are found there is no content. Content is stripped.

Streaming: text is held while the output may still be calls and sent at once as content when it
cannot be (a first character other than `{` or the tag, an object that is not a call, text after
an object other than `;`). Calls are only sent at `finish()`: until the end, more text could still
make the whole output content (Llama ends its turn right after the calls, so that costs nothing).
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (
    JSON_DECODER,
    ParsedOutput,
    StripFilter,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    call_from_object,
)

PYTHON_TAG = "<|python_tag|>"


def _skip_ws(text: str, pos: int) -> int:
    # Python's idea of whitespace, as str.strip() has, so that "\u00a0" between calls is not a
    # reason for the output to be content.
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _body(text: str) -> str | None:
    """The text after the optional python tag, or None if the output cannot be calls."""
    head = text.lstrip()
    if head.startswith(PYTHON_TAG):
        return head[len(PYTHON_TAG) :]
    return head if head.startswith("{") else None


def _scan_calls(body: str) -> tuple[list[ToolCall] | None, bool]:
    """(calls, cut): the complete calls at the start of `body` and whether it ends inside an
    unfinished object; calls is None when no continuation can make `body` calls."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        pos = _skip_ws(body, pos)
        if pos == len(body):
            return calls, False
        if body[pos] != "{":
            return None, False
        try:
            obj, pos = JSON_DECODER.raw_decode(body, pos)
        except (ValueError, RecursionError):
            # an object cut short looks the same as a broken one; only the end tells them apart
            return calls, True
        call = call_from_object(obj)
        if call is None:
            return None, False
        calls.append(call)
        pos = _skip_ws(body, pos)
        if pos == len(body):
            return calls, False
        if body[pos] != ";":
            return None, False
        pos += 1


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput:
        body = _body(text)
        calls, cut = _scan_calls(body) if body is not None else (None, False)
        if not calls or cut:  # a bare python tag, or an object that never ends, is not calls
            return ParsedOutput(content=text.strip() or None, tool_calls=[])
        return ParsedOutput(content=None, tool_calls=calls)

    def stream(self) -> Llama3JsonToolCallStream:
        return Llama3JsonToolCallStream()


class Llama3JsonToolCallStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._text = ""  # everything so far, while it may still be calls
        self._is_content = False  # decided: the output is content
        self._pending_object = False  # the last scan ended inside an unfinished object
        self._content = StripFilter()

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if self._is_content:
            return self._content.feed(delta), []
        self._text += delta
        head = self._text.lstrip()
        if len(head) < len(PYTHON_TAG) and PYTHON_TAG.startswith(head):
            return "", []  # nothing yet, or part of the tag: cannot tell
        body = _body(self._text)
        if body is None:
            return self._to_content(), []
        # An unfinished object can only end with a "}", so without one there is nothing to rescan.
        if self._pending_object and "}" not in delta:
            return "", []
        calls, self._pending_object = _scan_calls(body)
        if calls is None:
            return self._to_content(), []
        return "", []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._is_content:
            return self._content.finish(), []
        result = Llama3JsonToolParser().parse(self._text)
        if not result.tool_calls:
            out = self._to_content()
            self._content.finish()
            return out, []
        self._text = ""
        deltas: list[ToolCallDelta] = []
        for call in result.tool_calls:
            deltas.extend(self._emit(call))
        return "", deltas

    def _to_content(self) -> str:
        self._is_content = True
        text, self._text = self._text, ""
        return self._content.feed(text)
