"""What the offline LLM.score and the server's /score and /rerank share: the pairs a request
makes, and a pair's score from two embeddings (a model without a cross-encoder's head)."""

from __future__ import annotations

import math


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of the others (1:N), or each with its own (N:N)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("scoring needs at least one text on each side")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one, or as many")
    return list(zip(first, second))


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
