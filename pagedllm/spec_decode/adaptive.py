"""How many draft tokens each request gets this step: speculation only where it pays, measured.

A step's time is modelled as a + b x rows (rows: the tokens it computes), fitted over recent
decode-only steps; a draft token costs its step b more. Each request's drafts are accepted as a
run that breaks with probability 1 - alpha at every position (alpha: that request's recent
acceptance), so its j-th draft token adds alpha^j expected tokens. With B requests decoding, a
step makes B tokens in a + bB seconds; a draft token raises the rate only while
alpha^j > tau = bB / (a + bB): the j-th is proposed while that holds, up to the configured
num_speculative_tokens.

With a draft model, a draft token also costs its share of the draft's passes: the worker times
them (ModelRunnerOutput.draft_seconds), the fit takes the step's time without them, and a draft
token's cost is b + d (d: the seconds a request's token of a one-token pass of the draft takes,
averaged over recent steps; a catch-up over a new request's prompt is not a draft token's cost).

A request's alpha starts from the engine's recent acceptance over all requests (a draft's
acceptance differs less between requests than between drafts), and a request without drafts
drifts back to it, so that a skipped request is tried again.

So at batch 1, where a decode step reads every weight for one token and an extra row costs a
fraction of it, drafts go far; at a batch where rows cost about what a step costs per token
(tau near 1), nothing is proposed, and a request whose drafts keep failing (alpha small) is
skipped. Pure Python, beside the scheduler; the engine core times the steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class StepCostModel:
    """Step seconds = a + b x rows, by least squares over decode steps, each observation's weight
    decaying by `decay` a step. Until the steps seen vary enough in rows to tell b (drafts make
    them vary), b is 0: speculation is tried, and measured."""

    decay: float = 0.98
    min_spread: float = 0.25  # weighted variance of rows below which b stays as last measured
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, wx, wy, wxx, wxy
    b: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        s = self._sums
        for i, value in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            s[i] = s[i] * self.decay + value
        w, wx, wy, wxx, wxy = s
        spread = wxx / w - (wx / w) ** 2
        if spread >= self.min_spread:
            self.b = max((wxy / w - wx / w * wy / w) / spread, 0.0)

    def seconds(self, rows: int) -> float:
        """The step time the model expects for `rows` rows (0 before any step)."""
        w, wx, wy = self._sums[:3]
        if w == 0:
            return 0.0
        return wy / w + self.b * (rows - wx / w)


@dataclass
class Acceptance:
    """A request's recent acceptance: accepted drafts (successes) against runs broken before their
    end (failures), both decaying, from a prior of one each (alpha 0.5)."""

    successes: float = 1.0
    failures: float = 1.0

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def update(self, drafted: int, accepted: int, decay: float) -> None:
        self.successes = self.successes * decay + accepted
        self.failures = self.failures * decay + (1.0 if accepted < drafted else 0.0)

    def relax(self, rate: float, alpha: float) -> None:
        """A step without drafts: drift back toward two observations of acceptance `alpha`."""
        self.successes += (2 * alpha - self.successes) * rate
        self.failures += (2 * (1 - alpha) - self.failures) * rate

    @staticmethod
    def prior(alpha: float) -> Acceptance:
        """Two observations' worth of acceptance `alpha`."""
        return Acceptance(2 * alpha, 2 * (1 - alpha))


@dataclass
class SpeculationController:
    """Draft lengths per request (at most `max_k`), from the step cost model and each request's acceptance."""

    max_k: int
    decay: float = 0.7  # of a request's acceptance counts per verification: its last few drafts weigh most
    relax_rate: float = 0.05  # per step without drafts
    cost: StepCostModel = field(default_factory=StepCostModel)
    requests: dict[str, Acceptance] = field(default_factory=dict)
    draft_cost: float = 0.0  # d: a draft model's seconds a proposed token (0 for n-gram lookup)
    draft_decay: float = 0.9
    # Acceptance over all requests (slower to forget): new requests' prior, and where skipped ones drift.
    overall: Acceptance = field(default_factory=Acceptance)
    overall_decay: float = 0.98

    def threshold(self, batch: int) -> float:
        """tau: the least expected tokens a draft token must bring at this batch size."""
        step = self.cost.seconds(batch)
        return 0.0 if step <= 0 else min((self.cost.b + self.draft_cost) * batch / step, 1.0)

    def draft_lengths(self, request_ids: list[str]) -> dict[str, int]:
        """How many drafts each of the requests decoding this step may have (0: none)."""
        tau = self.threshold(len(request_ids))
        lengths = {}
        for request_id in request_ids:
            acceptance = self.requests.get(request_id)
            if acceptance is None:
                acceptance = self.requests[request_id] = Acceptance.prior(min(self.overall.alpha, 0.99))
            alpha = acceptance.alpha
            if tau <= 0 or alpha >= 1:
                lengths[request_id] = self.max_k
            else:
                lengths[request_id] = min(self.max_k, int(math.log(tau) / math.log(alpha)))
        return lengths

    def observe_draft(self, seconds: float, proposed: int) -> None:
        """A step's draft-model passes: `seconds` for `proposed` draft tokens."""
        if proposed:
            per_token = seconds / proposed
            self.draft_cost = (
                per_token
                if self.draft_cost == 0
                else self.draft_cost * self.draft_decay + per_token * (1 - self.draft_decay)
            )

    def observe(self, drafted: dict[str, tuple[int, int]], decode_rows: int | None, seconds: float) -> None:
        """After a step: (drafts, accepted) of each request that had drafts; decode_rows, the step's
        rows where every request in it was decoding (else None: a prompt chunk's step is not timed);
        seconds: the step's time without a draft model's passes."""
        for counts in drafted.values():
            self.overall.update(*counts, self.overall_decay)
        for request_id, acceptance in self.requests.items():
            if request_id in drafted:
                acceptance.update(*drafted[request_id], self.decay)
            else:
                acceptance.relax(self.relax_rate, min(self.overall.alpha, 0.99))
        if decode_rows is not None:
            self.cost.observe(decode_rows, seconds)

    def retain(self, request_ids: set[str]) -> None:
        """Forget requests that are no longer running."""
        for request_id in [r for r in self.requests if r not in request_ids]:
            del self.requests[request_id]
