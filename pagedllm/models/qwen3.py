"""Qwen3: RMSNorm of each q and k head before rotary; its own head_dim; no qkv bias by default."""

from __future__ import annotations

from pagedllm.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    # Per-head RMSNorm of q and k before rotary (the C++ decoder stack takes it: Attention.kernel_spec).
    qk_norm = True
