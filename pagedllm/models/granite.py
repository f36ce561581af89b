"""Granite (IBM's Granite 3): Llama's layers with four multipliers from its config: the embeddings
times embedding_multiplier, attention scores scaled by attention_multiplier (in place of
head_dim^-0.5), each sublayer's output times residual_multiplier before it joins the residual
(op by op: the C++ stack adds them unscaled), and the logits divided by logits_scaling. llama.cpp
writes it as a llama file (Q/K rows interleaved) of architecture "granite" with the multipliers as
granite.embedding_scale, .residual_scale, .attention.scale and .logit_scale."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.decoder import DecoderForCausalLM
from pagedllm.models.gguf import GGUFFormat, family_config, field_value

# config field -> its GGUF key (after "granite.")
GGUF_MULTIPLIERS = {
    "embedding_multiplier": "embedding_scale",
    "residual_multiplier": "residual_scale",
    "attention_multiplier": "attention.scale",
    "logits_scaling": "logit_scale",
}


def granite_gguf_config(reader, values: dict, arch: str = "granite", **fields):
    """Granite's config from a granite (or granitemoe) file: the multipliers where it has them."""
    multipliers = {name: field_value(reader, f"{arch}.{key}") for name, key in GGUF_MULTIPLIERS.items()}
    present = {name: float(value) for name, value in multipliers.items() if value is not None}
    config_class, architecture = (
        ("GraniteConfig", "GraniteForCausalLM") if arch == "granite" else ("GraniteMoeConfig", "GraniteMoeForCausalLM")
    )
    return family_config(config_class, architecture, values, **present, **fields)


class GraniteMultipliers:
    """Granite's four multipliers on a causal LM of the shared decoder (Granite-MoE's too)."""

    config: Any
    model: nn.Module

    def __init__(self, config, max_positions: int, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, max_positions, quant_config)
        for layer in self.model.layers:
            layer.self_attn.scale = config.attention_multiplier
            layer.residual_multiplier = config.residual_multiplier

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling


class GraniteForCausalLM(GraniteMultipliers, DecoderForCausalLM):
    gguf = GGUFFormat(permuted_qk=True, transformers_key="llama", config=granite_gguf_config)
