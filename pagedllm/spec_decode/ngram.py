"""N-gram proposals (prompt lookup): where the sequence's last n tokens occurred before, propose the
tokens that followed them there. No second model: outputs that copy from their input (editing code,
summarizing, answering from a document) accept many of them. Pure numpy, no torch: it runs in the
engine core beside the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NgramProposer:
    """`k` tokens a proposal, from a match of the last `max_n` tokens, else of fewer, down to `min_n`."""

    k: int
    min_n: int = 2
    max_n: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"prompt_lookup_min ({self.min_n}) must be >= 1 and <= prompt_lookup_max ({self.max_n})")
        if self.k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.k}")

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """Up to min(k, limit) tokens that followed the latest earlier occurrence of the sequence's
        longest suffix (max_n down to min_n tokens) that occurred before; [] if none did."""
        k = self.k if limit is None else min(self.k, limit)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Earlier positions i whose token equals the last one (i < len - 1: a token follows them),
        # then those among them where the n tokens before match too, n growing while any do: one
        # pass over the sequence, then only over the candidates left (every step runs this).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        n, longest = 1, min(self.max_n, len(tokens) - 1)
        while n < longest and ends.size:
            reach = ends[ends >= n]  # those with n tokens before them
            extended = reach[tokens[reach - n] == tokens[-1 - n]]
            if not extended.size:
                break
            ends, n = extended, n + 1
        if n < self.min_n or not ends.size:
            return []
        start = int(ends[-1]) + 1  # the latest occurrence, where its continuation starts
        return tokens[start : start + k].tolist()
