"""Worker: one device's share of the work. It loads its model (shard), allocates its KV cache and
runs each step through its model runner. It knows of requests only what the step messages tell
it, and keeps that (the model runner's InputBatch), so that each step need bring only what changed."""
from __future__ import annotations

import torch

from pagedllm.core.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.models.loader import ModelConfig, load_model
from pagedllm.worker.model_runner import ModelRunner, kv_cache_bytes_per_block


class Worker:
    def __init__(self, model_config: ModelConfig, device: str, block_size: int) -> None:
        self.model_config, self.device, self.block_size = model_config, device, block_size
        self.model: torch.nn.Module | None = None
        self.model_runner: ModelRunner | None = None

    def kv_cache_bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.model_config, self.block_size)

    def load_model(self) -> None:
        self.model = load_model(self.model_config, self.device)

    def initialize_cache(self, num_blocks: int) -> None:
        if self.model is None:
            raise RuntimeError("load the model before allocating its KV cache")
        self.model_runner = ModelRunner(self.model_config, self.model, num_blocks, self.block_size, self.device)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute(scheduler_output)
