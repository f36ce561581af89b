"""The structured-output backend on xgrammar (the library vLLM uses by default; it runs on the CPU).

JSON schemas, regular expressions and EBNF grammars compile into a grammar over the tokenizer's
vocabulary; a choice among strings compiles as an EBNF alternation of its literal strings."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import (
    GrammarKey,
    GrammarMatcher,
    InvalidConstraintError,
    StructuredOutputBackend,
)

if TYPE_CHECKING:
    import xgrammar as xgr


def _xgr() -> ModuleType:
    """xgrammar, imported on the first constrained request: at start-up it would cost every engine
    0.6 s and 45 MiB resident (it brings in its tokenizer and testing machinery)."""
    import xgrammar

    return xgrammar


class XgrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        import torch

        self._matcher.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XgrammarBackend(StructuredOutputBackend):
    """`get_tokenizer`: returns the Hugging Face tokenizer (the engine core's process loads its own
    only once a constrained request arrives). `vocab_size`: the model's logits' width, which may
    exceed the tokenizer's (tokens past it are never allowed)."""

    def __init__(self, get_tokenizer: Callable[[], object], vocab_size: int, stop_token_ids: list[int]) -> None:
        self._get_tokenizer = get_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler: xgr.GrammarCompiler | None = None

    @staticmethod
    def check(params: StructuredOutputsParams) -> None:
        kind, text, _ = params.key
        try:
            _grammar(kind, text, compact=False)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidConstraintError(f"invalid structured output {kind}: {_reason(exc)}") from None

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        return self._get_compiler().compile_grammar(_grammar(*key))

    def matcher(self, compiled: xgr.CompiledGrammar) -> XgrammarMatcher:
        return XgrammarMatcher(_xgr().GrammarMatcher(compiled))  # any number of tokens can be rolled back

    def allocate_bitmask(self, rows: int) -> np.ndarray:
        return np.full((rows, _xgr().get_bitmask_shape(1, self.vocab_size)[1]), -1, dtype=np.int32)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        # Built on first use, in the compiling thread: the tokenizer's vocabulary takes ~0.1 s to index.
        if self._compiler is None:
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(
                self._get_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            # Few threads: compiling shares the CPU with the engine's forward passes.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


def _grammar(kind: str, text: str, compact: bool) -> xgr.Grammar:
    """The constraint as an xgrammar Grammar (no vocabulary needed: this is also the check)."""
    xgr = _xgr()
    if kind == "json":
        json.loads(text)  # a clear "not JSON" before xgrammar's own message
        return _json_grammar(text, compact)
    if kind == "json_object":
        return _json_grammar('{"type": "object"}', compact)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        # EBNF string literals take JSON's escapes; ensure_ascii keeps every character one escape.
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in json.loads(text)))
    return xgr.Grammar.from_ebnf(text)


# xgrammar 0.2.8 writes a string with minLength/maxLength as a repeat of the class [^"\\\r\n], which
# lets raw control characters through: invalid JSON, which strict parsers (pydantic's included)
# refuse (xgrammar issue #800). The class is narrowed to exclude all of U+0000-U+001F. Such strings
# still take no escapes (nor did xgrammar's): adding them as an alternative made the rule one that
# xgrammar cannot precompute, and filling a mask inside such a string took 25 ms instead of 0.1.
_BOUNDED_STRING_ITEM = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHARACTER = r'\1 ::= (([^\\0-\\x1f\\"\\\\]))'


def _json_grammar(schema: str, compact: bool) -> xgr.Grammar:
    xgr = _xgr()
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=not compact)
    text, count = _BOUNDED_STRING_ITEM.subn(_JSON_CHARACTER, str(grammar))
    return xgr.Grammar.from_ebnf(text) if count else grammar


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location and assertion ("[time] file.cc:123:
    Check failed: (...) is false: ...")."""
    message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip())
    message = re.sub(r"^Check failed: .*? is false:\s*", "", message)
    return message.splitlines()[0] if message else type(exc).__name__
