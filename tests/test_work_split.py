"""kernels/work_split.h, the sharing of a parallel loop's items among threads that the linear and
attention kernels use: every item exactly once; a thread owns a contiguous share (by count, or by
weight) and works through it from the front; a thread that is done takes the others' items from
the back. Observed through work_split_trace, whose thread 0 starts late."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.kernels import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="no C++ toolchain here")

LATE_US = 200_000  # long enough for the other thread to take every item of these tests first


@pytest.mark.parametrize("items", [0, 1, 3, 7, 100, 1000])
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("delay_us", [0, 2000])
def test_every_item_once(items, threads, delay_us):
    trace = cpu_ops().work_split_trace(items, threads, delay_us)
    assert sorted(item for item, _ in trace) == list(range(items))


@settings(max_examples=50, deadline=None)
@given(weights=st.lists(st.integers(1, 10_000), max_size=300), threads=st.integers(1, 4))
def test_every_item_once_by_weight(weights, threads):
    trace = cpu_ops().work_split_trace(len(weights), threads, 0, weights)
    assert sorted(item for item, _ in trace) == list(range(len(weights)))
    assert all(0 <= thread < threads for _, thread in trace)


def _late_thread_0(items: int, own_from: int) -> list[tuple[int, int]]:
    """Thread 1's takes when thread 0 sleeps through them: its own share (from `own_from`) front to
    back, then thread 0's from the back."""
    return [(i, 1) for i in range(own_from, items)] + [(i, 1) for i in range(own_from - 1, -1, -1)]


def test_the_others_take_a_late_threads_share():
    assert cpu_ops().work_split_trace(100, 2, LATE_US) == _late_thread_0(100, 50)


@pytest.mark.parametrize(
    "weights, own_from",
    [
        ([1] * 100, 50),
        ([50] + [1] * 50, 1),  # the heavy first item is half the work: thread 0's whole share
        ([1] * 50 + [50], 50),
        ([3, 1, 1, 1], 1),
        ([10, 10, 10], 2),  # the middle item's middle falls on the half: the first share takes it
    ],
)
def test_shares_by_weight(weights, own_from):
    trace = cpu_ops().work_split_trace(len(weights), 2, LATE_US, weights)
    assert trace == _late_thread_0(len(weights), own_from)


def test_one_weight_an_item():
    with pytest.raises(RuntimeError, match="one weight an item"):
        cpu_ops().work_split_trace(3, 2, 0, [1, 2])
