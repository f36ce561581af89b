"""The priority scheduling policy: admission by (priority, arrival), preemption of lower priorities,
arrival order within one priority; the same schedules as fcfs when every priority is 0."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams


def _scheduler(num_blocks: int, max_num_seqs: int = 8, budget: int = 64, policy: str = "priority") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 256, policy=policy), KVCacheManager(num_blocks, 4))


def _request(rid: str, priority: int, prompt: int = 4, max_tokens: int = 8, token: int = 1) -> Request:
    request = Request(rid, [token] * prompt, SamplingParams(max_tokens=max_tokens), max_tokens)
    request.priority = priority
    return request


def _step(scheduler: Scheduler) -> list[str]:
    """One step; every sampling request gets token 5. The ids scheduled, in the step's order."""
    output = scheduler.schedule()
    scheduler.update(output, ModelRunnerOutput({s.request_id: [5] for s in output.scheduled if s.sample}))
    return [s.request_id for s in output.scheduled]


def test_admission_goes_by_priority_then_arrival():
    scheduler = _scheduler(64, max_num_seqs=1)
    for rid, priority in [("a", 3), ("b", 1), ("c", 1), ("d", -2)]:
        scheduler.add_request(_request(rid, priority, token=ord(rid)))
    order = []
    while scheduler.has_unfinished_requests():
        for rid in _step(scheduler):
            if rid not in order:
                order.append(rid)
    assert order == ["d", "b", "c", "a"]


def test_a_dry_pool_preempts_the_lowest_priority_newest():
    # 3 requests of 4 prompt tokens in blocks of 4: 2 blocks each once they decode; 5 blocks for 3.
    scheduler = _scheduler(5)
    low_old, low_new, high = (
        _request("low_old", 2, token=1),
        _request("low_new", 2, token=2),
        _request("high", 0, token=3),
    )
    for request in (low_old, low_new, high):  # the newest is the high one: fcfs would preempt it
        scheduler.add_request(request)
    while not any(r.num_preemptions for r in (low_old, high, low_new)):
        _step(scheduler)
    assert low_new.num_preemptions == 1 and low_old.num_preemptions == 0 and high.num_preemptions == 0


def test_a_higher_priority_arrival_preempts_a_lower_one_and_runs_in_the_same_step():
    scheduler = _scheduler(64, max_num_seqs=2)
    lows = [_request(f"low{i}", 5, max_tokens=50, token=i + 1) for i in range(2)]
    for request in lows:
        scheduler.add_request(request)
    _step(scheduler)
    _step(scheduler)
    urgent = _request("urgent", 0, token=9)
    scheduler.add_request(urgent)
    scheduled = _step(scheduler)
    assert "urgent" in scheduled and "low1" not in scheduled  # the newest low one made room
    assert lows[1].status == RequestStatus.PREEMPTED and lows[0].status == RequestStatus.RUNNING
    assert scheduler.num_preemptions == 1


def test_equal_priorities_never_preempt_each_other():
    scheduler = _scheduler(64, max_num_seqs=1)
    first = _request("first", 1, max_tokens=20, token=1)
    scheduler.add_request(first)
    _step(scheduler)
    scheduler.add_request(_request("second", 1, token=2))
    while first.status == RequestStatus.RUNNING:
        assert _step(scheduler) == ["first"]
    assert scheduler.num_preemptions == 0


def test_a_preempted_request_waits_behind_higher_priorities():
    scheduler = _scheduler(64, max_num_seqs=1)
    low = _request("low", 9, max_tokens=30, token=1)
    scheduler.add_request(low)
    _step(scheduler)
    for rid in ("u1", "u2"):
        scheduler.add_request(_request(rid, 0, max_tokens=3, token=ord(rid[1])))
    steps = []
    while scheduler.has_unfinished_requests():
        steps.append(_step(scheduler))
    first_low = next(i for i, s in enumerate(steps) if s == ["low"])
    assert all(s != ["low"] for s in steps[:first_low]) and {"u1", "u2"} <= {r for s in steps[:first_low] for r in s}
    assert low.num_output_tokens == 30


# Pools of 11 blocks or more hold the largest request whole (42 tokens in blocks of 4).
workload = st.lists(
    st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 5)), min_size=1, max_size=10
)  # (prompt length, max_tokens, arrival step)


def _trace(policy: str, requests: list[tuple[int, int, int]], num_blocks: int) -> list[list[tuple[str, int]]]:
    scheduler = _scheduler(num_blocks, max_num_seqs=3, budget=16, policy=policy)
    pending = sorted(enumerate(requests), key=lambda x: x[1][2])
    steps = []
    for step in range(3000):
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _) = pending.pop(0)
            # (Prompts of their own: no request waits for another's blocks, whose place in the queue
            # fcfs keeps at the front and priority by arrival.)
            scheduler.add_request(_request(f"r{i}", 0, prompt, max_tokens, token=i + 1))
        if not pending and not scheduler.has_unfinished_requests():
            return steps
        output = scheduler.schedule()
        steps.append([(s.request_id, s.num_new_tokens) for s in output.scheduled])
        scheduler.update(output, ModelRunnerOutput({s.request_id: [5] for s in output.scheduled if s.sample}))
    raise AssertionError("requests never finished")


@settings(max_examples=60, deadline=None)
@given(workload, st.integers(11, 40))
def test_all_priorities_zero_schedule_as_fcfs(requests, num_blocks):
    assert _trace("priority", requests, num_blocks) == _trace("fcfs", requests, num_blocks)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 5), st.integers(-3, 3)), max_size=10),
    st.integers(11, 40),
)
def test_random_priorities_finish_everything_and_leak_nothing(requests, num_blocks):
    kv = KVCacheManager(num_blocks, 4)
    scheduler = Scheduler(SchedulerConfig(3, 16, 256, policy="priority"), kv)
    made = [_request(f"r{i}", p, prompt, m, token=i % 7 + 1) for i, (prompt, m, _, p) in enumerate(requests)]
    pending = sorted(zip(made, requests), key=lambda x: x[1][2])
    for step in range(5000):
        while pending and pending[0][1][2] <= step:
            scheduler.add_request(pending.pop(0)[0])
        if not pending and not scheduler.has_unfinished_requests():
            break
        _step(scheduler)
    else:
        raise AssertionError("requests never finished")
    assert [r.num_output_tokens for r in made] == [m for _, m, _, _ in requests]
    assert kv.num_free_blocks == kv.pool.num_blocks and not scheduler.requests
