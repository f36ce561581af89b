"""Mistral: Llama's layers; attention within the config's sliding window (every layer's)."""

from __future__ import annotations

from pagedllm.models.decoder import DecoderForCausalLM
from pagedllm.models.gguf import GGUFFormat


class MistralForCausalLM(DecoderForCausalLM):
    """The shared decoder reads the window from the config (DecoderConfig.sliding_windows)."""

    gguf = GGUFFormat(permuted_qk=True)  # llama.cpp interleaves its Q/K rows
