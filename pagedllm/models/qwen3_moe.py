"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3's attention (per-head q/k norm) over sparse MoE MLPs."""

from __future__ import annotations

from pagedllm.models.gguf import GGUFFormat
from pagedllm.models.moe import SparseMoEForCausalLM


class Qwen3MoeForCausalLM(SparseMoEForCausalLM):
    gguf = GGUFFormat(transformers_key="qwen3_moe")
    qk_norm = True
