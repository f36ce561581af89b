"""The adaptive speculation controller: its step cost model, each request's acceptance, and the draft
lengths that follow (pure Python: no model)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.spec_decode.adaptive import Acceptance, SpeculationController, StepCostModel


def test_cost_model_fits_a_line_once_rows_vary():
    model = StepCostModel()
    for _ in range(20):
        model.observe(1, 0.005)  # batch-1 decodes only: nothing tells a row's cost yet
    assert model.b == 0 and model.seconds(1) == pytest.approx(0.005)
    for rows in (5, 1, 3, 8, 1, 5) * 5:
        model.observe(rows, 0.005 + 0.0008 * (rows - 1))
    assert model.b == pytest.approx(0.0008, rel=1e-6)
    assert model.seconds(9) == pytest.approx(0.005 + 0.0008 * 8, rel=1e-6)


def test_cost_model_keeps_its_slope_when_rows_stop_varying():
    model = StepCostModel()
    for rows in (1, 9) * 10:
        model.observe(rows, 0.004 + 0.001 * rows)
    for _ in range(500):  # speculation stopped: every step has the same rows (and the machine slowed)
        model.observe(32, 0.040)
    # The slope measured while rows varied is kept (somewhat pulled by the new pace), not lost.
    assert model.b == pytest.approx(0.001, rel=0.3)
    assert model.seconds(32) == pytest.approx(0.040, rel=1e-3)


def test_acceptance_is_the_geometric_estimate_of_recent_runs():
    a = Acceptance()
    assert a.alpha == 0.5
    a.update(drafted=4, accepted=4, decay=1.0)  # all taken: 4 successes, no failure
    a.update(drafted=4, accepted=1, decay=1.0)
    assert a.alpha == pytest.approx((1 + 5) / (1 + 5 + 1 + 1))
    for _ in range(200):
        a.relax(0.05, alpha=0.5)
    assert a.alpha == pytest.approx(0.5, abs=1e-3)


def controller_after(b: float, a: float, batch: int, max_k: int = 8) -> SpeculationController:
    """A controller whose cost model measured steps of a + b x rows around this batch size."""
    controller = SpeculationController(max_k)
    for extra in (0, 4, 1, 8, 2) * 4:
        controller.cost.observe(batch + extra, a + b * (batch + extra))
    return controller


def test_drafts_go_far_at_batch_one_and_stop_where_rows_cost_a_steps_share():
    cheap = controller_after(b=0.0008, a=0.005, batch=1)
    tau = cheap.threshold(1)
    assert tau == pytest.approx(0.0008 / 0.0058)
    cheap.requests["copying"] = Acceptance(successes=9, failures=1)  # alpha 0.9
    cheap.requests["novel"] = Acceptance(successes=1, failures=9)  # alpha 0.1
    lengths = cheap.draft_lengths(["copying", "novel"])
    assert lengths["copying"] == 8  # 0.9^8 = 0.43 > tau: up to max_k
    assert lengths["novel"] == 0  # 0.1 < tau: skipped
    # At 32 requests where an extra row costs what a step costs per request, nothing pays.
    busy = controller_after(b=0.001, a=0.0005, batch=32)
    busy.requests["copying"] = Acceptance(successes=9, failures=1)
    assert busy.threshold(32) > 0.95
    assert busy.draft_lengths([f"r{i}" for i in range(31)] + ["copying"])["copying"] == 0


def test_new_requests_start_from_the_engines_acceptance():
    controller = controller_after(b=0.0008, a=0.005, batch=1)
    for _ in range(40):
        controller.observe({"old": (4, 4)}, 5, 0.0082)  # a draft that is nearly always right
    assert controller.overall.alpha > 0.95
    assert controller.draft_lengths(["new"])["new"] == 8  # not the 0.5 of knowing nothing


def test_a_skipped_request_is_tried_again():
    controller = controller_after(b=0.0008, a=0.005, batch=1)
    controller.requests["r"] = Acceptance(successes=0.1, failures=3)
    assert controller.draft_lengths(["r"])["r"] == 0
    steps = 0
    while controller.draft_lengths(["r"])["r"] == 0:
        controller.observe({}, 1, 0.0058)
        steps += 1
    assert 5 < steps < 100


def test_observe_learns_acceptance_and_forgets_finished_requests():
    controller = SpeculationController(4)
    controller.draft_lengths(["a", "b"])
    controller.observe({"a": (4, 0)}, None, 1.0)  # a prompt chunk's step: not timed
    assert controller.requests["a"].alpha < controller.requests["b"].alpha
    assert controller.cost.seconds(1) == 0
    controller.retain({"b"})
    assert set(controller.requests) == {"b"}


@settings(max_examples=200, deadline=None)
@given(
    b=st.floats(0, 0.01),
    a=st.floats(1e-4, 0.05),
    batch=st.integers(1, 64),
    max_k=st.integers(1, 10),
    successes=st.floats(0.01, 50),
    failures=st.floats(0.01, 50),
)
def test_lengths_are_bounded_and_follow_the_threshold(b, a, batch, max_k, successes, failures):
    controller = controller_after(b, a, batch, max_k)
    ids = [f"r{i}" for i in range(batch)]
    controller.requests["r0"] = Acceptance(successes, failures)
    length = controller.draft_lengths(ids)["r0"]
    assert 0 <= length <= max_k
    alpha, tau = controller.requests["r0"].alpha, controller.threshold(batch)
    # Each draft proposed is worth its cost (alpha^j >= tau), and the next one, had it been allowed, was not.
    if length:
        assert alpha**length >= tau * (1 - 1e-9)
    if length < max_k:
        assert alpha ** (length + 1) <= tau * (1 + 1e-9) or math.isclose(alpha ** (length + 1), tau)
    # A request that accepts more never gets fewer drafts.
    controller.requests["r0"] = Acceptance(successes + 1, failures)
    assert controller.draft_lengths(ids)["r0"] >= length


def test_a_draft_models_passes_count_in_a_draft_tokens_cost():
    """With a draft model, a draft token costs a verification row (b) and its share of the draft's
    passes (d): a draft that costs most of a step per token is proposed only where it is accepted
    almost always."""
    controller = controller_after(b=0.0008, a=0.009, batch=1)
    controller.requests["r"] = Acceptance(successes=9, failures=1)  # alpha 0.9
    assert controller.draft_lengths(["r"])["r"] == 8
    for _ in range(30):
        controller.observe_draft(seconds=4 * 0.006, proposed=4)
    assert controller.draft_cost == pytest.approx(0.006)
    assert controller.threshold(1) == pytest.approx((0.0008 + 0.006) / 0.0098)
    assert controller.draft_lengths(["r"])["r"] == 3  # 0.9^3 = 0.73 > tau 0.69 > 0.9^4
