"""The uniprocess executor: one worker, called directly in the engine's thread."""

from __future__ import annotations

import torch

from pagedllm.config import KVOffloadConfig, ModelConfig
from pagedllm.core.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.executor.thread_governor import make_governor
from pagedllm.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(
        self, model_config: ModelConfig, device: str, block_size: int, draft_config: ModelConfig | None = None
    ) -> None:
        self.driver_worker = Worker(model_config, device, block_size, draft_config)
        # Built in the thread that steps (torch's thread count is the calling thread's own).
        self.governor = make_governor(torch.get_num_threads(), torch.set_num_threads) if device == "cpu" else None

    def kv_cache_bytes_per_block(self) -> int:
        return self.driver_worker.kv_cache_bytes_per_block()

    def load_model(self) -> None:
        self.driver_worker.load_model()

    def device_kv_budget(self, utilization: float, num_tokens: int, num_seqs: int) -> int:
        return self.driver_worker.device_kv_budget(utilization, num_tokens, num_seqs)

    def initialize_cache(self, num_blocks: int, kv_offload: KVOffloadConfig | None = None) -> None:
        self.driver_worker.initialize_cache(num_blocks, kv_offload)

    def stored_block_hashes(self) -> list[int]:
        return self.driver_worker.stored_block_hashes()

    def shutdown(self) -> None:
        self.driver_worker.shutdown()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self.driver_worker.execute_model(scheduler_output)
        if self.governor is not None:
            self.governor.stepped()
        return output
