"""Qwen3: RMSNorm of each q and k head before rotary; its own head_dim; no qkv bias by default."""

from __future__ import annotations

from pagedllm.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    # The C++ decoder stack has no kernel for this norm: Qwen3's layers run op by op.
    qk_norm = True
