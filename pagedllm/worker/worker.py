"""Worker: one device's share of the work. It loads its model (shard), allocates its KV cache and
runs each step through its model runner. It knows of requests only what the step messages tell
it, and keeps that (the model runner's InputBatch), so that each step need bring only what changed."""

from __future__ import annotations

import logging

import torch

from pagedllm.config import KVOffloadConfig, ModelConfig
from pagedllm.core.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed import parallel_state
from pagedllm.models.loader import load_model
from pagedllm.worker.draft_runner import draft_kv_bytes_per_block
from pagedllm.worker.model_runner import ModelRunner, kv_cache_bytes_per_block, profile_pass

logger = logging.getLogger(__name__)

# The sampler's fp32 copies of a step's logits (penalties, softmax, sorted top-p) at once, at most.
SAMPLER_COPIES = 4


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

    def device_kv_budget(self, utilization: float, num_tokens: int, num_seqs: int) -> int:
        """vLLM's sizing: `utilization` of the GPU's memory, less the weights, a profiled pass's
        peak (num_tokens tokens, num_seqs rows of logits and the sampler's copies of them; once
        more for the CUDA graphs' pool where they are captured) and what is not torch's (the CUDA
        context, other processes)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        weights = torch.cuda.memory_allocated()
        profile_pass(self.model, self.model_config, num_tokens, num_seqs, self.block_size, self.device)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - weights
        peak += SAMPLER_COPIES * num_seqs * self.model_config.vocab_size * 4
        free, total = torch.cuda.mem_get_info()
        not_torch = total - free - torch.cuda.memory_reserved()
        graphs = peak if self.model_config.cuda_graph_sizes else 0
        budget = int(total * utilization) - weights - peak - graphs - not_torch
        logger.info(
            "GPU memory: %.2f GiB in all, %.0f%% for the engine: weights %.2f GiB, a pass's peak %.2f GiB, "
            "other %.2f GiB: %.2f GiB for the KV cache",
            total / 2**30, utilization * 100, weights / 2**30, (peak + graphs) / 2**30, not_torch / 2**30,
            max(budget, 0) / 2**30,
        )  # fmt: skip
        torch.cuda.empty_cache()
        return max(budget, 0)

    def initialize_cache(self, num_blocks: int, kv_offload: KVOffloadConfig | None = None) -> None:
        if self.model is None:
            raise RuntimeError("load the model before allocating its KV cache")
        draft = (self.draft_config, self.draft_model) if self.draft_model is not None else None
        store = None
        if kv_offload is not None:
            from pagedllm.worker.kv_store import KVStore  # (LMDB: only where the store is asked for)

            store = KVStore(kv_offload, parallel_state.tensor_parallel().rank)
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
