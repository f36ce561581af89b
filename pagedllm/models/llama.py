"""Llama (Llama-3's rope scaling included; tied embeddings where the config ties them)."""

from __future__ import annotations

from pagedllm.models.decoder import DecoderForCausalLM
from pagedllm.models.gguf import GGUFFormat


class LlamaForCausalLM(DecoderForCausalLM):
    """The shared decoder as it is: q/k/v and o biases only where the config sets attention_bias."""

    gguf = GGUFFormat(permuted_qk=True)  # llama.cpp interleaves its Q/K rows
