"""Tool calls the server guarantees by constraining the output with the tools' JSON schemas, as
vLLM does for `tool_choice` "required" and a named function. The constraint makes the output
parse; these read it back as calls, in full and streaming.

- a named function: the output is its arguments, a JSON object under its parameters' schema;
- "required": the output is a JSON array of {"name", "parameters"} objects, one per call (at least
  one; exactly one when parallel_tool_calls is false), each under its tool's schema.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    call_from_object,
    loads_json,
)

ANY_OBJECT: dict[str, Any] = {"type": "object"}
# OpenAI: a function defined without `parameters` takes none, so its arguments are `{}`.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema of a function's arguments: none without `parameters`, any object for `{}`."""
    if parameters is None:
        return NO_PARAMETERS
    return parameters or ANY_OBJECT


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of "required" tool calls over `tools` (OpenAI's function definitions)."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool["name"]]},
                "parameters": parameters_schema(tool.get("parameters")),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedFunctionOutput(ToolParser):
    """The output is the named function's arguments."""

    name = "named_function"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str) -> ParsedOutput:
        if not _is_object(text):  # cut short (max_tokens): no call, the text as it is
            return ParsedOutput(text or None, [])
        return ParsedOutput(None, [ToolCall(self.function, text)])

    def stream(self) -> ToolCallStream:
        return _NamedStream(self.function)


class _NamedStream(ToolCallStream):
    """The arguments go out as they are generated, after a first delta with the call's id and name."""

    def __init__(self, function: str) -> None:
        super().__init__()
        self._call = ToolCall(function, "")
        self._started = False

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if not delta:
            return "", []
        self._call.arguments += delta
        deltas = [] if self._started else [ToolCallDelta(0, self._call.id, self._call.name, "")]
        self._started = True
        return "", deltas + [ToolCallDelta(0, arguments=delta)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if _is_object(self._call.arguments):
            self._calls = [self._call]
        return "", []


class RequiredFunctionsOutput(ToolParser):
    """The output is a JSON array of calls."""

    name = "required_functions"

    def parse(self, text: str) -> ParsedOutput:
        try:
            items = loads_json(text)
        except ValueError:
            return ParsedOutput(text or None, [])
        calls = [call_from_object(item) for item in items] if isinstance(items, list) else [None]
        if not calls or None in calls:
            return ParsedOutput(text or None, [])
        return ParsedOutput(None, calls)

    def stream(self) -> ToolCallStream:
        return _RequiredStream(self)


class _RequiredStream(ToolCallStream):
    """Each call goes out (its two deltas: id and name, then arguments) as soon as its element of
    the array is complete; the grammar makes the text well-formed, so a scan of brackets outside
    strings finds the elements' ends."""

    def __init__(self, parser: RequiredFunctionsOutput) -> None:
        super().__init__()
        self._parser = parser
        self._text = ""
        self._scanned = 0  # characters of _text scanned so far
        self._depth = 0  # brackets open at _scanned
        self._in_string = self._escaped = False
        self._element_start = -1  # where the element being written began
        self._failed = False  # an element that is not a call: the whole output is content

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self._text += delta
        deltas: list[ToolCallDelta] = []
        for i in range(self._scanned, len(self._text)):
            end = self._scan(self._text[i], i)
            if end is not None and not self._failed:
                call = _element_call(self._text[self._element_start : end])
                self._failed = call is None
                deltas += self._emit(call) if call is not None else []
        self._scanned = len(self._text)
        return "", deltas

    def _scan(self, char: str, index: int) -> int | None:
        """Track strings and brackets; returns the end of an array element that `char` closes."""
        if self._in_string:
            escaped, self._escaped = self._escaped, not self._escaped and char == "\\"
            self._in_string = escaped or char != '"'
            return None
        if char == '"':
            self._in_string = True
        elif char in "[{":
            self._depth += 1
            if self._depth == 2:
                self._element_start = index
        elif char in "]}":
            self._depth -= 1
            if self._depth == 1:
                return index + 1
        return None

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        parsed = self._parser.parse(self._text)
        if parsed.tool_calls and not self._failed and len(parsed.tool_calls) == len(self._calls):
            return "", []
        # Cut short (max_tokens) or not calls after all: the text is content; calls already sent stay sent.
        return ("" if self._calls else parsed.content or ""), []


def _element_call(text: str) -> ToolCall | None:
    try:
        return call_from_object(loads_json(text))
    except ValueError:
        return None


def _is_object(text: str) -> bool:
    try:
        return isinstance(loads_json(text), dict)
    except ValueError:
        return False
