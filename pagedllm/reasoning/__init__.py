"""Reasoning parsers, chosen by name as vLLM's `--reasoning-parser NAME` chooses them."""

from __future__ import annotations

from pagedllm.reasoning.parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser, ReasoningStream

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name`; ValueError naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}") from None


__all__ = [
    "REASONING_PARSERS",
    "get_reasoning_parser",
    "ReasoningParser",
    "ReasoningStream",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
]
