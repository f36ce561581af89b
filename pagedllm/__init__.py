"""pagedllm: paged KV cache, continuous batching, an offline API shaped like vLLM's."""
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import BeamSearchOutput, CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "EngineArgs", "RequestOutput", "CompletionOutput",
           "Logprob", "BeamSearchOutput"]
__version__ = "0.1.0"
