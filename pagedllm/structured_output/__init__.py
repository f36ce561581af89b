"""Structured output: constrained decoding behind a small backend interface (backend.py), on
xgrammar (xgrammar_backend.py); the engine core's side is manager.py."""

from pagedllm.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from pagedllm.structured_output.manager import StructuredOutputManager, StructuredOutputStats

__all__ = ["GrammarMatcher", "StructuredOutputBackend", "StructuredOutputManager", "StructuredOutputStats"]
