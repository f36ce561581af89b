"""Qwen2: biases on q, k and v (none on o); sliding windows on the layers the config names."""

from __future__ import annotations

from pagedllm.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    always_qkv_bias = True  # Qwen2's configs carry no attention_bias flag: the biases are always there
