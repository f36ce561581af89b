"""The scheduler's waiting queue, by policy: arrival order (fcfs) or (priority, arrival) (priority)."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from pagedllm.core.request import Request


def fcfs_key(request: Request) -> int:
    return request.arrival_seq


def priority_key(request: Request) -> tuple[int, int]:
    return request.priority, request.arrival_seq


class FCFSQueue(deque):
    """Arrival order; a request put back in front (preempted, deferred) goes first."""


class PriorityQueue:
    """Requests kept sorted by (priority, arrival): lower priority values first, ties by arrival.
    A request put back (preempted, deferred) takes its place by that key, not the front."""

    def __init__(self, key: Callable[[Request], tuple[int, int]] = priority_key) -> None:
        self._key = key
        self._items: list[Request] = []

    def append(self, request: Request) -> None:
        bisect.insort(self._items, request, key=self._key)

    appendleft = append

    def extendleft(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.append(request)

    def popleft(self) -> Request:
        return self._items.pop(0)

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
