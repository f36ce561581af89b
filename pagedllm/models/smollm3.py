"""SmolLM3 (Hugging Face): Llama's layers, some without rotary embeddings (NoPE): config.no_rope_layers
has a 1 for each layer that rotates q and k, a 0 for one that does not (every fourth, by default).
Op by op (the C++ stack rotates every layer). llama.cpp writes it as a llama file (Q/K rows
interleaved) of architecture "smollm3" with no key for the NoPE layers: its loader takes every
fourth, as the config's default interval does."""

from __future__ import annotations

from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.decoder import DecoderForCausalLM
from pagedllm.models.gguf import GGUFFormat, family_config

GGUF_NO_ROPE_INTERVAL = 4  # llama.cpp's, fixed for the architecture


def smollm3_gguf_config(reader, values: dict):
    return family_config("SmolLM3Config", "SmolLM3ForCausalLM", values, no_rope_layer_interval=GGUF_NO_ROPE_INTERVAL)


class SmolLM3ForCausalLM(DecoderForCausalLM):
    gguf = GGUFFormat(permuted_qk=True, transformers_key="llama", config=smollm3_gguf_config)

    def __init__(self, config, max_positions: int, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, max_positions, quant_config)
        for layer, rotates in zip(self.model.layers, config.no_rope_layers):
            layer.self_attn.use_rope = bool(rotates)
