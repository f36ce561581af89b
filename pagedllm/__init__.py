"""pagedllm: paged KV cache, continuous batching, an offline API shaped like vLLM's."""
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
