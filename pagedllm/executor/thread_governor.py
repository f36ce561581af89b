"""How many threads the engine's steps use, following how busy the machine is.

A parallel region ends when its slowest thread does. When another process wants one of our cores,
the scheduler preempts one of our threads for a time slice, and every region it was part of waits
for it: on 2 cores with one busy neighbour, 2 threads decode far slower than 1 (docs/benchmarks-history.md,
issue 42). The sign is the stepping thread's time spent runnable but waiting for a core (the
kernel's schedstat), which stays near zero while we have the cores to ourselves.

So after each window of stepping, the governor reads that wait as a share of the stepping
thread's time: above `HIGH` it takes a thread away; after a quiet spell it tries one more for a window, keeps it
if the wait stays low, and otherwise goes back and waits twice as long before the next try (up
to `MAX_PROBE_S`). The thread count never changes a result: every kernel computes a row the same
way whatever the count (tests/test_thread_governor.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger("pagedllm")

WINDOW_S = 0.25  # of stepping, between two readings
MIN_BUSY_S = 0.05  # a window decides only with at least this much thread time in it
HIGH = 0.25  # waiting share above which a thread is taken away: far from a quiet machine's and a busy one's
FIRST_PROBE_S = 2.0
MAX_PROBE_S = 8.0
ADAPTIVE_ENV = "PAGEDLLM_ADAPTIVE_THREADS"


def thread_schedstat() -> tuple[int, int]:
    """Run and run-queue wait nanoseconds of the calling thread (Linux schedstat). The stepping
    thread leads every parallel region and is preempted as often as its helpers; the process's
    other threads (the server's event loop, tokenizers) are left out: their waits are ours."""
    with open("/proc/thread-self/schedstat", "rb") as f:
        run, wait = f.read().split()[:2]
    return int(run), int(wait)


def schedstat_available() -> bool:
    return os.path.exists("/proc/thread-self/schedstat")


class ThreadGovernor:
    """Call `stepped()` after each engine step; it sets the thread count through `set_threads`."""

    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        read: Callable[[], tuple[int, int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = self.threads = max_threads
        self._set, self._read, self._clock = set_threads, read, clock
        self._probing_from: int | None = None  # the count a probe of one more thread came from
        self._probe_wait_s = FIRST_PROBE_S
        self._window_start = self._last_change = clock()
        self._start_sample: tuple[int, int] | None = None  # read by the stepping thread, at its first step

    def stepped(self) -> None:
        now = self._clock()
        if self._start_sample is None:
            self._window_start, self._start_sample = now, self._read()
            return
        if now - self._window_start < WINDOW_S:
            return
        run, wait = self._read()
        d_run, d_wait = run - self._start_sample[0], wait - self._start_sample[1]
        self._window_start, self._start_sample = now, (run, wait)
        if d_run + d_wait < MIN_BUSY_S * 1e9:  # mostly idle: nothing to learn
            return
        self._decide(d_wait / (d_run + d_wait), now)

    def _decide(self, waiting: float, now: float) -> None:
        if self._probing_from is not None:  # a probe's window
            came_from, self._probing_from = self._probing_from, None
            if waiting > HIGH:
                self._probe_wait_s = min(2 * self._probe_wait_s, MAX_PROBE_S)
                self._change(came_from, now, waiting, logging.DEBUG)
            else:
                self._probe_wait_s = FIRST_PROBE_S
                logger.info(
                    "CPU threads: back to %d (waiting for a core %.0f%% of the time)", self.threads, 100 * waiting
                )
            return
        if waiting > HIGH and self.threads > 1:
            self._change(self.threads - 1, now, waiting, logging.INFO)
        elif self.threads < self.max_threads and now - self._last_change >= self._probe_wait_s:
            self._probing_from = self.threads
            self._change(self.threads + 1, now, waiting, logging.DEBUG)

    def _change(self, threads: int, now: float, waiting: float, level: int) -> None:
        logger.log(
            level,
            "CPU threads: %d -> %d (the engine's thread waited for a core %.0f%% of the last %.2f s: "
            "other processes are using the cores)"
            if threads < self.threads
            else "CPU threads: %d -> %d (trying one more; waiting %.0f%% of the last %.2f s)",
            self.threads,
            threads,
            100 * waiting,
            WINDOW_S,
        )
        self.threads, self._last_change = threads, now
        self._set(threads)


def make_governor(max_threads: int, set_threads: Callable[[int], None]) -> ThreadGovernor | None:
    """A governor for this process's steps, unless the thread count is fixed (OMP_NUM_THREADS or
    PAGEDLLM_ADAPTIVE_THREADS=0), there is one thread to govern, or the kernel keeps no schedstat."""
    if "OMP_NUM_THREADS" in os.environ or os.environ.get(ADAPTIVE_ENV, "1") == "0" or max_threads < 2:
        return None
    if not schedstat_available():
        return None
    return ThreadGovernor(max_threads, set_threads, thread_schedstat)
