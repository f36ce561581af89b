"""What every tool-call parser shares: the call and delta shapes, the parser and stream interfaces,
and small text helpers for streaming (partial tags, whitespace stripping across deltas).

Whitespace rule for all tool parsers: `content` is the text outside the calls joined together and
then stripped (`str.strip()`), None when that leaves nothing. A stream applies the same rule across
deltas: it drops leading whitespace and holds trailing whitespace back until more text follows (or
drops it at `finish()`), so the content it returns joins to exactly `parse(text).content or ""`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object as text: json.dumps(arguments_dict, ensure_ascii=False)
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")


@dataclass
class ParsedOutput:
    content: str | None  # the text that is not a tool call, stripped; None when nothing is left
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    """One streaming piece of a call, in OpenAI's delta shape."""

    index: int  # the call's index among this choice's calls (0, 1, ...)
    id: str | None = None  # only on the call's first delta
    name: str | None = None  # only on the call's first delta
    arguments: str = ""  # a fragment; the fragments of one index join to ToolCall.arguments


class ToolCallStream:
    """Fed a choice's text as it is generated, split anywhere, returns what can be sent now."""

    def __init__(self) -> None:
        self._calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """(content text to send now, tool-call deltas)."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of generation: flush what was held back."""
        raise NotImplementedError

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The complete calls seen so far, with the ids their deltas carried."""
        return list(self._calls)

    def _emit(self, call: ToolCall) -> list[ToolCallDelta]:
        # A call is only sent once it is complete and known to be valid: until its closing markup
        # it could still turn out malformed, and then it is content, not a call. Its deltas take
        # OpenAI's shape anyway (id and name first, arguments after) so clients need no special case.
        index = len(self._calls)
        self._calls.append(call)
        return [
            ToolCallDelta(index=index, id=call.id, name=call.name, arguments=""),
            ToolCallDelta(index=index, arguments=call.arguments),
        ]


class ToolParser:
    """One model family's tool-call format. Stateless; `stream()` makes the per-choice state."""

    name: str = ""

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def stream(self) -> ToolCallStream:
        raise NotImplementedError


def _reject_constant(token: str) -> Any:
    # Python's JSON reader takes NaN and Infinity, which are not JSON: json.dumps would write them
    # back out and a client's parser would then fail on the arguments.
    raise ValueError(f"not JSON: {token}")


JSON_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def loads_json(text: str) -> Any:
    """json.loads that refuses NaN/Infinity; raises ValueError on anything that is not JSON."""
    try:
        return JSON_DECODER.decode(text)
    except RecursionError as e:  # absurdly deep nesting: not a call either
        raise ValueError("JSON nested too deep") from e


def call_from_object(obj: Any) -> ToolCall | None:
    """A call from a decoded {"name": ..., "arguments"|"parameters": ...}; None if it is not one.

    Arguments may be an object or a JSON string holding one (some models write them that way);
    either way they come out as the object's JSON text. Missing or null arguments are {}.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = loads_json(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    text = json.dumps(args, ensure_ascii=False)
    try:
        text.encode("utf-8")  # a lone surrogate ("\ud800" in the JSON) could not be sent
    except UnicodeEncodeError:
        return None
    return ToolCall(name=name, arguments=text)


class StripFilter:
    """Streams text so that what it returns joins to the whole text `.strip(chars)`: leading
    `chars` are dropped, trailing ones are held until more text follows or dropped at finish."""

    def __init__(self, chars: str | None = None) -> None:
        self._chars = chars
        self._started = False
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip(self._chars)
            self._started = bool(text)
        text = self._held + text
        out = text.rstrip(self._chars)
        self._held = text[len(out) :]
        return out

    def finish(self) -> str:
        self._held = ""
        return ""
