"""Rejection sampling of draft tokens: what comes out is distributed as the target's own draws."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.worker.rejection_sampler import draw, rejection_sample

# Chi-square critical values at p = 0.001 by degrees of freedom (a fixed table: no scipy needed).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of counts against a distribution (over the tokens it can draw)."""
    expected = probs / probs.sum() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_draw_inverts_the_cumulative_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    assert [draw(probs, u) for u in (0.0, 0.09, 0.1, 0.69, 0.7, 0.999)] == [0, 0, 2, 2, 3, 3]


def _first_tokens(p: torch.Tensor, q: torch.Tensor, trials: int, seed: int) -> list[int]:
    """The first token out of each trial: a fresh draft drawn from q, then the rejection step."""
    rng = random.Random(seed)
    out = []
    for _ in range(trials):
        drafts = [draw(q[j], rng.random()) for j in range(q.shape[0])]
        out.append(rejection_sample(p, q, drafts, lambda j, purpose: rng.random())[0])
    return out


@pytest.mark.parametrize("case", ["far", "near", "disjoint-support"])
def test_the_first_token_follows_the_target_not_the_draft(case):
    vocab = 6
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, vocab, generator=g) * 2, dim=-1)
    if case == "far":
        q = torch.softmax(torch.randn(2, vocab, generator=g) * 2, dim=-1)
    elif case == "near":
        q = p[:2] * 0.8 + 0.2 / vocab
    else:  # the draft puts mass where the target has none, and none on the target's favourite
        p[0] = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])
        q = torch.tensor([[0.0, 0.2, 0.1, 0.3, 0.2, 0.2]] * 2)
    trials = 6000
    counts = torch.bincount(torch.tensor(_first_tokens(p, q, trials, seed=1)), minlength=vocab).double()
    expected = p[0].double() * trials
    keep = expected > 0
    assert counts[~keep].sum() == 0  # never a token the target cannot draw
    # Chi-square against the target's distribution: a wrong sampler (say, keeping every draft)
    # lands far outside this bound with these counts (checked below for the draft's own).
    bound = CHI2_999[int(keep.sum()) - 1]
    assert chi2(counts[keep], p[0].double()[keep]) < bound
    # The same bound tells the draft's distribution apart: a sampler that kept every draft fails.
    if case == "far":
        assert chi2(counts[keep], q[0].double()[keep]) > 10 * bound


def test_all_drafts_accepted_where_the_draft_is_the_target():
    p = torch.softmax(torch.randn(4, 10, generator=torch.Generator().manual_seed(3)), dim=-1)
    rng = random.Random(0)
    for _ in range(50):
        drafts = [draw(p[j], rng.random()) for j in range(3)]
        tokens = rejection_sample(p, p[:3].clone(), drafts, lambda j, purpose: rng.random())
        assert tokens[:3] == drafts and len(tokens) == 4


def test_a_rejected_draft_ends_the_run_with_a_residual_token():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    assert rejection_sample(p, q, [0], lambda j, purpose: 0.5) == [1]  # p(0) = 0: rejected; residual is token 1
