"""Worker: one device's share of the work. It loads its model (shard), allocates its KV cache and
runs each step through its model runner. It knows of requests only what the step messages tell
it, and keeps that (the model runner's InputBatch), so that each step need bring only what changed."""

from __future__ import annotations

import torch

from pagedllm.config import KVOffloadConfig, ModelConfig
from pagedllm.core.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed import parallel_state
from pagedllm.models.loader import load_model
from pagedllm.worker.draft_runner import draft_kv_bytes_per_block
from pagedllm.worker.kv_store import KVStore
from pagedllm.worker.model_runner import ModelRunner, kv_cache_bytes_per_block


class Worker:
    def __init__(
        self, model_config: ModelConfig, device: str, block_size: int, draft_config: ModelConfig | None = None
    ) -> None:
        self.model_config, self.device, self.block_size = model_config, device, block_size
        self.draft_config = draft_config  # draft-model speculation's draft, loaded beside the target
        self.model: torch.nn.Module | None = None
        self.draft_model: torch.nn.Module | None = None
        self.model_runner: ModelRunner | None = None

    def kv_cache_bytes_per_block(self) -> int:
        """A block of the target's K/V (and of the draft's, which shares the block tables)."""
        draft = draft_kv_bytes_per_block(self.draft_config, self.block_size) if self.draft_config else 0
        return kv_cache_bytes_per_block(self.model_config, self.block_size) + draft

    def load_model(self) -> None:
        self.model = load_model(self.model_config, self.device)
        if self.draft_config is not None:
            self.draft_model = load_model(self.draft_config, self.device)

    def initialize_cache(self, num_blocks: int, kv_offload: KVOffloadConfig | None = None) -> None:
        if self.model is None:
            raise RuntimeError("load the model before allocating its KV cache")
        draft = (self.draft_config, self.draft_model) if self.draft_model is not None else None
        store = KVStore(kv_offload, parallel_state.tensor_parallel().rank) if kv_offload is not None else None
        self.model_runner = ModelRunner(
            self.model_config, self.model, num_blocks, self.block_size, self.device, draft, store
        )

    def stored_block_hashes(self) -> list[int]:
        """The block hashes the KV store (--kv-offload-dir) holds for this model and rank."""
        store = self.model_runner.kv_store if self.model_runner is not None else None
        return store.hashes() if store is not None else []

    def shutdown(self) -> None:
        """Write what the KV store has queued and close it."""
        store = self.model_runner.kv_store if self.model_runner is not None else None
        if store is not None:
            store.close()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute(scheduler_output)

    def collective_time(self) -> tuple[float, int, int]:
        """Tensor parallelism: (seconds in collectives, their number, the bytes this rank put in)
        since the last call."""
        seconds, calls, nbytes = parallel_state.collective_time
        parallel_state.collective_time[:] = [0.0, 0, 0]
        return seconds, calls, nbytes
