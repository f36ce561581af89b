"""Mistral: Llama's layers; attention within the config's sliding window (every layer's)."""

from __future__ import annotations

from pagedllm.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    """The shared decoder reads the window from the config (DecoderConfig.sliding_windows)."""
