"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): qkv biases, and a shared expert beside the routed ones."""

from __future__ import annotations

from pagedllm.models.gguf import GGUFFormat
from pagedllm.models.moe import SparseMoEForCausalLM


class Qwen2MoeForCausalLM(SparseMoEForCausalLM):
    gguf = GGUFFormat(transformers_key="qwen2_moe")
    always_qkv_bias = True
    shared_expert = True
