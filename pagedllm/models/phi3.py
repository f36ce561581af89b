"""Phi-3 and Phi-4-mini: the Llama-like decoder, its checkpoint's q/k/v and gate/up already fused
(loaded whole into our fused layers), LongRoPE scaling (layers/rotary.py), and a partial rotary
(Phi-4-mini rotates 3/4 of each head: q and k rows are put in partial_rotary_order as they load,
so the full-width rotary kernels compute it)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from pagedllm.layers.rotary import partial_rotary_order, rotary_dim
from pagedllm.models.decoder import DecoderForCausalLM
from pagedllm.models.gguf import GGUFFormat, field_value

# llama.cpp keeps Phi-3's fused q/k/v and gate/up (gate/up as "ffn_up"), and LongRoPE's factors as
# tensors, which are config.
GGUF_LAYER_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
GGUF_ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def phi3_gguf_config(reader, values: dict):
    """Phi-3's config class with its rope parameters from the file: the rotated share of a head
    (rope.dimension_count; Phi-4-mini rotates 3/4) and, where the file has them, LongRoPE's factors
    (tensors) and original context."""
    from transformers import Phi3Config

    values = {k: v for k, v in values.items() if k != "model_type"}
    head_dim = values["hidden_size"] // values["num_attention_heads"]
    rope = {
        "rope_type": "default",
        "rope_theta": float(values.pop("rope_theta", 10000.0)),
        "partial_rotary_factor": (field_value(reader, "phi3.rope.dimension_count") or head_dim) / head_dim,
    }
    factors = {
        GGUF_ROPE_FACTORS[t.name]: [float(x) for x in np.asarray(t.data, dtype=np.float32)]
        for t in reader.tensors
        if t.name in GGUF_ROPE_FACTORS
    }
    if factors:
        original = field_value(reader, "phi3.rope.scaling.original_context_length")
        rope.update(rope_type="longrope", original_max_position_embeddings=int(original), **factors)
        if field_value(reader, "phi3.rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = float(field_value(reader, "phi3.rope.scaling.attn_factor"))
    return Phi3Config(**values, rope_parameters=rope, architectures=["Phi3ForCausalLM"])


class Phi3ForCausalLM(DecoderForCausalLM):
    gguf = GGUFFormat(GGUF_LAYER_NAMES, config_tensors=GGUF_ROPE_FACTORS, config=phi3_gguf_config)
    fused_checkpoint = True
    stacked_params = ()  # the checkpoint's qkv_proj and gate_up_proj are ours, whole

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg = self.decoder_config
        rotated = rotary_dim(self.config, cfg.head_dim)
        if rotated < cfg.head_dim:
            weights = self._reorder_qk(weights, partial_rotary_order(cfg.head_dim, rotated))
        super().load_weights(weights)

    def _reorder_qk(self, weights: Iterable[tuple[str, torch.Tensor]], order: list[int]) -> Iterator:
        cfg = self.decoder_config
        index = torch.tensor(order)
        heads = cfg.num_heads + cfg.num_kv_heads
        for name, tensor in weights:
            if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
                if isinstance(tensor, torch.Tensor):
                    tensor = _reorder_rows(tensor, heads, cfg.head_dim, index)
                else:  # a GGUF file's quantized rows, as raw blocks: rows move whole
                    tensor.raw = _reorder_rows(tensor.raw, heads, cfg.head_dim, index)
            yield name, tensor


def _reorder_rows(rows: torch.Tensor, heads: int, head_dim: int, index: torch.Tensor) -> torch.Tensor:
    """The q and k rows of a fused q/k/v weight, each head's in `index` order; v's as they are."""
    qk = rows[: heads * head_dim].reshape(heads, head_dim, *rows.shape[1:])[:, index]
    return torch.cat([qk.reshape(-1, *rows.shape[1:]), rows[heads * head_dim :]])
