"""What every tensor-parallel executor shares, whatever starts its ranks (worker processes,
multiproc.py; Ray actors, ray_executor.py): a rank's start and its answer to a call, on the
rank's side; on the engine's, sending each call to every rank and judging their answers.

The engine sends every call to every rank and takes rank 0's answer: the ranks sample the same
tokens from the same all-gathered logits, so each rank's model runner keeps the same state
without being told. An answer is ("ok", value) or ("error", (type name, text)). An error every rank raised
(the same inputs fail alike: a request's bad rows) is the step's, raised as the uniprocess
executor would; one that only some raised, a rank that dies, or ranks that stop answering (left
waiting in a collective) are the executor's failure, which the engine core takes as fatal.
"""

from __future__ import annotations

import math
import os
import socket
import time
import traceback
from abc import abstractmethod
from collections.abc import Hashable
from typing import Any

from pagedllm.config import KVOffloadConfig, ModelConfig
from pagedllm.core.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor, ExecutorFailure
from pagedllm.executor.cpu_binding import physical_cores_of
from pagedllm.worker.model_runner import kv_cache_bytes_per_block

STARTUP_TIMEOUT_S = 600.0  # a rank's load of a large model from a slow disk
ERROR_GRACE_S = 30.0  # after one rank's error, how long the others may take to report theirs


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on this machine now (rank 0's, for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_rank(
    rank: int,
    size: int,
    init_method: str,
    region: str | None,
    model_config: ModelConfig,
    device: str,
    block_size: int,
    cores: list[int] | None,
    threads: int | None,
    seed: int | None,
):
    """On the rank: its cores and threads, the group joined, its worker built (not loaded yet)."""
    import torch

    from pagedllm.distributed.parallel_state import init_tensor_parallel
    from pagedllm.worker.worker import Worker

    if cores is not None:
        os.sched_setaffinity(0, cores)
        threads = len(physical_cores_of(cores))
    if threads is not None:
        torch.set_num_threads(threads)
    # The same seed on every rank: their samplers draw alike, so their runners keep one state.
    torch.manual_seed(seed if seed is not None else 0)
    init_tensor_parallel(rank, size, init_method, torch.device(device).type, shared_region=region)
    return Worker(model_config, device, block_size)


def answer(worker, rank: int, method: str, args: tuple) -> tuple[str, Any]:
    """On the rank: the worker's `method(*args)` as an answer (the value only from rank 0); an
    error as (its type's name, its message)."""
    try:
        result = getattr(worker, method)(*args)
    except Exception as exc:  # noqa: BLE001 - the engine decides what it means
        return "error", (type(exc).__name__, f"{type(exc).__name__}: {exc}")
    return "ok", result if rank == 0 else None


def start_failure() -> tuple[str, tuple[str, str]]:
    return "error", ("RuntimeError", traceback.format_exc(limit=8))


class RanksExecutor(Executor):
    """An executor of `size` ranks reached through handles the subclass sends calls on, waits on
    and receives from (pipes, Ray object refs)."""

    model_config: ModelConfig
    block_size: int
    size: int

    def kv_cache_bytes_per_block(self) -> int:
        """A block on all ranks together (the widest rank's share, on each): the KV memory budget
        is the engine's, not each rank's."""
        return kv_cache_bytes_per_block(self.model_config, self.block_size, self.size) * self.size

    def load_model(self) -> None:
        self._call("load_model", timeout=STARTUP_TIMEOUT_S)

    def initialize_cache(self, num_blocks: int, kv_offload: KVOffloadConfig | None = None) -> None:
        self._call("initialize_cache", num_blocks, kv_offload, timeout=STARTUP_TIMEOUT_S)

    def stored_block_hashes(self) -> list[int]:
        return self._call("stored_block_hashes", timeout=STARTUP_TIMEOUT_S)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", scheduler_output)

    def collective_time(self) -> tuple[float, int, int]:
        """Rank 0's seconds in collectives, their number and its bytes in them since the last call (benchmarks)."""
        return self._call("collective_time")

    @abstractmethod
    def _send(self, method: str, args: tuple) -> dict[Hashable, int]:
        """Send the call to every rank: a handle to each rank's answer -> its rank."""

    @abstractmethod
    def _wait(self, handles: list, timeout: float | None) -> list:
        """The handles whose answers have come (or whose rank died), waiting up to `timeout`."""

    @abstractmethod
    def _receive(self, handle: Hashable, rank: int) -> tuple[str, Any]:
        """The rank's answer; raises ExecutorFailure if the rank died."""

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Every rank's `method(*args)`; rank 0's result."""
        return self._collect(self._send(method, args), timeout)[0]

    def _collect(self, pending: dict[Hashable, int], timeout: float | None) -> list[Any]:
        """Each rank's answer, in rank order. Every rank is waited on at once, so that a rank's
        death raises as it happens."""
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str]] = {}  # rank -> (the error's type name, its text)
        pending = dict(pending)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            if errors:  # the others have a grace period from the first error on
                deadline = min(deadline or math.inf, time.monotonic() + ERROR_GRACE_S)
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = self._wait(list(pending), wait_s)
            if not ready:
                late = sorted(pending.values())
                raise ExecutorFailure(
                    f"tensor-parallel ranks {late} did not answer in time"
                    + (f" after rank {min(errors)} failed: {errors[min(errors)][1]}" if errors else "")
                )
            for handle in ready:
                rank = pending.pop(handle)
                status, value = self._receive(handle, rank)
                (errors if status == "error" else results)[rank] = value
        if errors and len(errors) < self.size:
            raise ExecutorFailure(f"tensor-parallel rank {min(errors)} failed alone: {errors[min(errors)][1]}")
        if errors:  # a ValueError stays one (a bad input or set-up, said at start-up as such)
            kind, text = errors[0]
            raise (ValueError if kind == "ValueError" else RuntimeError)(text)
        return [results[rank] for rank in range(self.size)]
