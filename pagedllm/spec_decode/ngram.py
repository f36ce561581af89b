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
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # Windows of n tokens that end before the suffix starts: those with a token after them.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n  # the latest occurrence, where its continuation starts
                return tokens[start:start + k].tolist()
        return []
