"""Rejection sampling of a draft model's tokens (Leviathan et al., 2023; Chen et al., 2023).

The draft proposed d_1..d_k, each drawn from its distribution q_j; the target's distributions at
those positions are p_j (after the request's own processing: penalties, temperature, top-k/p).
Draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); the first rejected one is
replaced by a draw from the residual max(0, p_j - q_j), normalized, and nothing after it counts;
if all k are accepted, a token is drawn from p_{k+1}. Every token that comes out is then
distributed exactly as the target's own sampling would draw it. Greedy requests never come here:
their drafts are accepted while they equal the target's argmax.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def draw(probs: torch.Tensor, u: float) -> int:
    """The token whose cumulative probability first passes u (in [0, 1)) x the total: inverse-CDF
    sampling, as the sampler's; tokens of probability 0 are never drawn."""
    cdf = probs.double().cumsum(dim=0)
    index = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype) * cdf[-1], right=True)[0])
    return min(index, probs.shape[0] - 1)


def rejection_sample(
    target: torch.Tensor, draft: torch.Tensor, draft_tokens: list[int], uniform: Callable[[int, str], float]
) -> list[int]:
    """target: [k + 1, vocab] probabilities p_1..p_{k+1}; draft: [k, vocab] q_1..q_k; the k draft
    tokens. uniform(j, purpose) is the uniform number for position j ("accept", "residual", or
    "sample" for the bonus token). Returns the accepted drafts, then one token of the target's."""
    tokens: list[int] = []
    for j, token in enumerate(draft_tokens):
        p, q = float(target[j, token]), float(draft[j, token])
        if uniform(j, "accept") * q < p:  # u < p / q; q > 0 for a token the draft drew
            tokens.append(token)
            continue
        residual = (target[j] - draft[j]).clamp_(min=0)
        # p <= q everywhere (a rejection where p equals q to rounding): p itself is the residual's limit.
        tokens.append(draw(residual if float(residual.sum()) > 0 else target[j], uniform(j, "residual")))
        return tokens
    tokens.append(draw(target[len(draft_tokens)], uniform(len(draft_tokens), "sample")))
    return tokens
