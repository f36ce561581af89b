"""Executor: what the engine asks of the workers, wherever they run.

The engine sizes the KV cache from `kv_cache_bytes_per_block` and its memory budget, then has the
workers load the model, allocate that many blocks, and execute each step. The uniprocess executor
(uniproc.py) runs one worker in the engine's thread; a multiprocess or Ray executor (tensor
parallelism) will start one worker per rank and gather rank 0's output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.config import KVOffloadConfig
from pagedllm.core.step import ModelRunnerOutput, SchedulerOutput


class ExecutorFailure(RuntimeError):
    """The executor itself failed (a worker died or stopped answering): no request's fault, and
    the engine cannot go on."""


class Executor(ABC):
    @abstractmethod
    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes on all the workers together (all layers, K and V)."""

    @abstractmethod
    def load_model(self) -> None: ...

    def device_kv_budget(self, utilization: float, num_tokens: int, num_seqs: int) -> int:
        """On a GPU, after the weights load: the bytes left for the KV cache within `utilization` of
        the device's memory, once a pass of `num_tokens` tokens and `num_seqs` samples has run."""
        raise ValueError("gpu_memory_utilization: this executor runs its workers on the CPU")

    @abstractmethod
    def initialize_cache(self, num_blocks: int, kv_offload: KVOffloadConfig | None = None) -> None:
        """Allocate the KV cache; with `kv_offload`, open each worker's KV store too."""

    @abstractmethod
    def stored_block_hashes(self) -> list[int]:
        """The block hashes the KV store holds for this model (rank 0's; none without a store)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:
        """Stop the workers this executor started (none for the uniprocess one)."""
