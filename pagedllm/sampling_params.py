"""SamplingParams: vLLM's fields and defaults, validated at construction."""

from __future__ import annotations

import inspect
import json as _json
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

_GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy


class InvalidParamError(ValueError):
    """A parameter's value is invalid; `param` names the field, for the API's error."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output, at the end (offline generate)


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class StructuredOutputsParams:
    """What a constrained request's output must match, as vLLM names it: exactly one of a JSON
    schema (`json`, a dict or its text), any JSON object (`json_object=True`), a regular expression,
    one of a list of strings (`choice`), or an EBNF grammar (GBNF, as xgrammar reads it).
    `disable_any_whitespace`: JSON without free whitespace between its tokens (compact output;
    small models otherwise tend to spend their tokens on newlines)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [
            k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)
        ]
        _check(
            len(kinds) == 1,
            f"structured outputs take exactly one of json, regex, choice, grammar, json_object; got {kinds or 'none'}",
        )
        if self.choice is not None:
            _check(
                isinstance(self.choice, list) and self.choice and all(isinstance(c, str) for c in self.choice),
                "structured outputs' choice is a non-empty list of strings",
            )
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            _check(
                value is None or (isinstance(value, str) and value != ""),
                f"structured outputs' {kind} is a non-empty string",
            )
        _check(
            self.json is None or isinstance(self.json, (str, dict)),
            "structured outputs' json is a schema (dict or text)",
        )

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, text, compact): what a compiled grammar is cached by."""
        compact = self.disable_any_whitespace
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else _json.dumps(self.json), compact
        if self.json_object:
            return "json_object", "", compact
        if self.regex is not None:
            return "regex", self.regex, compact
        if self.choice is not None:
            return "choice", _json.dumps(self.choice), compact
        return "grammar", self.grammar or "", compact


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Words never to generate (vLLM's): the frontend turns them into token ids (below), and a word's
    # last token is barred wherever the output so far ends with the rest of it.
    bad_words: list[str] | None = None
    # V0 vLLM's per-request processors: each takes (output_ids, logits) or (prompt_ids, output_ids,
    # logits), a row of [vocab] float logits, and returns the row to sample from. Offline only.
    logits_processors: list[Callable] | None = None
    # bad_words as the frontend tokenized them (LLMEngine.process_inputs); an init field so that
    # dataclasses.replace (seeded samples) keeps it.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(
            -2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
        )
        _check(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}",
        )
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 0),
            f"max_tokens must be an integer >= 0, got {self.max_tokens!r}",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens must be >= 0, got {self.min_tokens!r}",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
            f"logprobs must be an integer >= 0, got {self.logprobs!r}",
        )
        _check(
            self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
            f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids must not be empty")
        if self.bad_words is not None:
            _check(
                isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                f"bad_words must be a list of non-blank strings, got {self.bad_words!r}",
            )
        if self.logits_processors is not None:
            _check(isinstance(self.logits_processors, list), "logits_processors must be a list of callables")
            for processor in self.logits_processors:
                _check(
                    processor_arity(processor) in (2, 3),
                    f"logits_processors: {processor!r} must be a callable taking (output_ids, logits) "
                    "or (prompt_ids, output_ids, logits)",
                )
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams",
        )

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the user gave must exist in the model's vocabulary."""
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids", "bad_words_token_ids"):
            values = getattr(self, name) or ()
            if name == "bad_words_token_ids":
                values = [t for word in values for t in word]
            bad = [t for t in values if not 0 <= t < vocab_size]
            if bad:
                param = name.removesuffix("_token_ids") if name == "bad_words_token_ids" else name
                raise InvalidParamError(f"{param}: token ids out of vocabulary (size {vocab_size}): {bad[:5]}", param)


def processor_arity(processor: Callable) -> int | None:
    """How many positional arguments a logits processor takes (2 or 3 are valid); None: not a callable."""
    if not callable(processor):
        return None
    try:
        parameters = inspect.signature(processor).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class BeamSearchParams:
    """Beam search as vLLM's LLM.beam_search takes it (deterministic: temperature 0 only)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check(
            isinstance(self.beam_width, int) and self.beam_width >= 1,
            f"beam_width must be >= 1, got {self.beam_width!r}",
        )
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            f"max_tokens must be >= 1, got {self.max_tokens!r}",
        )
        _check(self.temperature == 0.0, "beam search here is deterministic: temperature must be 0")
