"""Faults injected on purpose (`PAGEDLLM_FAULT`), so that tests exercise the failure paths for real,
in the engine the server runs, not in a mock.

    PAGEDLLM_FAULT=token:ID   the model runner raises in every step whose batch computes token ID:
                              a failure of one request, which the engine pins on it and ends
    PAGEDLLM_FAULT=fatal:N    the engine step raises after N steps, outside the model runner: the
                              engine's own state is in doubt and it cannot go on
    PAGEDLLM_FAULT=slow:MS    every step takes MS milliseconds longer (requests that stay in flight)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from pagedllm.core.request import Request
from pagedllm.core.step import ScheduledRequest, SchedulerOutput


class InjectedFault(RuntimeError):
    pass


@dataclass
class FaultInjector:
    token: int | None = None
    fatal_after: int | None = None
    slow_ms: int = 0
    steps: int = 0

    @classmethod
    def from_env(cls) -> FaultInjector:
        spec = os.environ.get("PAGEDLLM_FAULT", "")
        if not spec:
            return cls()
        kind, _, value = spec.partition(":")
        field = {"token": "token", "fatal": "fatal_after", "slow": "slow_ms"}.get(kind)
        if field is None or not value.isdigit():
            raise ValueError(f"PAGEDLLM_FAULT={spec!r}: expected token:ID, fatal:N or slow:MS")
        return cls(**{field: int(value)})

    def in_execute(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """`requests`: the scheduler's, where the step's tokens are (its message carries only drafts)."""
        if self.slow_ms:
            time.sleep(self.slow_ms / 1000)
        if self.token is not None and any(
            self.token in _step_tokens(s, requests[s.request_id]) for s in scheduler_output.scheduled
        ):
            raise InjectedFault(f"injected fault: token {self.token} in the batch")

    def after_execute(self) -> None:
        self.steps += 1
        if self.fatal_after is not None and self.steps > self.fatal_after:
            raise InjectedFault(f"injected fatal fault after {self.fatal_after} steps")


def _step_tokens(scheduled: ScheduledRequest, request: Request) -> list[int]:
    start = scheduled.num_computed_tokens
    return request.all_token_ids[start : start + scheduled.num_new_tokens] + scheduled.spec_token_ids
