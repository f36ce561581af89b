"""pagedllm: paged KV cache, continuous batching, an offline API shaped like vLLM's."""

import os

# OpenMP threads spin for a while after each parallel region before they sleep (GNU's default is
# 300,000 spins). Between the engine's operators that spinning takes the cores from the server's
# HTTP thread and from the next operator's threads: a shorter spin served 8% more output tokens/s
# under benchmarks/serve.py, the same offline. Read when torch loads its OpenMP, so set it first.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from pagedllm.logger import configure_logging  # noqa: E402

configure_logging()  # before the imports below, so a line logged while they load is shown

from pagedllm.config import EngineArgs  # noqa: E402
from pagedllm.lora.request import LoRARequest  # noqa: E402
from pagedllm.outputs import (  # noqa: E402
    BeamSearchOutput,
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams  # noqa: E402
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams  # noqa: E402


def __getattr__(name: str):
    """`LLM` is imported on first use: it brings torch, which the pure-Python core (`pagedllm.core`)
    and its users (a scheduler in another process, the tests of the core) do without."""
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")


__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "PoolingParams",
    "EngineArgs",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchOutput",
    "EmbeddingRequestOutput",
    "EmbeddingOutput",
    "ScoringRequestOutput",
    "ScoringOutput",
    "ClassificationRequestOutput",
    "ClassificationOutput",
]
__version__ = "0.1.0"
