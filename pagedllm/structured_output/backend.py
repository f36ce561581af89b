"""What the engine asks of a structured-output library: check a constraint (frontend), compile it
for the model's vocabulary (slow: off the engine loop), and per request a matcher that fills the
step's token mask and advances with each accepted token."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from pagedllm.sampling_params import StructuredOutputsParams

# The key StructuredOutputsParams.key gives: (kind, text, compact)
GrammarKey = tuple[str, str, bool]


class InvalidConstraintError(ValueError):
    """A structured output constraint that cannot be compiled (a bad schema, regex or grammar), or
    that this model's vocabulary cannot satisfy. Its name starts the error an engine core reports
    for such a request, so that the frontend answers it as the client's error (a 400)."""


class GrammarMatcher(ABC):
    """One request's place in its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance over a sampled token; False (state unchanged) if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Set row `row` of an int32 [rows, ceil(vocab / 32)] mask to the tokens allowed next."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (drafts a verification rejected)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""


class StructuredOutputBackend(ABC):
    @staticmethod
    @abstractmethod
    def check(params: StructuredOutputsParams) -> None:
        """Raise InvalidConstraintError, saying why, if the constraint cannot be compiled (needs no
        vocabulary)."""

    @abstractmethod
    def compile(self, key: GrammarKey) -> object:
        """The constraint compiled for the vocabulary (thread-safe; may take a while)."""

    @abstractmethod
    def matcher(self, compiled: object) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar."""

    @abstractmethod
    def allocate_bitmask(self, rows: int) -> np.ndarray:
        """An int32 [rows, ceil(vocab / 32)] mask, every token allowed."""
