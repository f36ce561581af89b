"""Tool-call parsers: a chat model's generated text into OpenAI tool calls, chosen by name as
vLLM's `--tool-call-parser NAME` chooses them."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
)
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called `name`; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; known parsers: {known}") from None


__all__ = [
    "TOOL_PARSERS",
    "get_tool_parser",
    "ToolParser",
    "ToolCallStream",
    "ToolCall",
    "ToolCallDelta",
    "ParsedOutput",
    "HermesToolParser",
    "Llama3JsonToolParser",
]
