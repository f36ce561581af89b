"""Rotary position embedding (neox / rotate-half layout, as Hugging Face Llama applies it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn



def rope_inv_freq(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for the config's rope type (llama3, linear, yarn...).
    `layer_type`: for configs with rope parameters per kind of layer (Gemma 3's "sliding_attention"
    and "full_attention", each with its own base)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK rope scaling depends on the sequence length and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    extra = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        self.config, self.head_dim, self.max_positions = config, head_dim, max_positions
        self.layer_type = layer_type
        self.build_tables("cpu")

    def build_tables(self, device: torch.device | str) -> None:
        # Its own device context: the model may be under construction on "meta".
        with torch.device(device):
            inv_freq, scale = rope_inv_freq(self.config, self.head_dim, self.layer_type)
            freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float), inv_freq)
        # [max_positions, head_dim]: cos and sin laid out for rotate-half.
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def tables(self, positions: torch.Tensor) -> RopeTables:
        return RopeTables(self.cos[positions], self.sin[positions])


@dataclass
class RopeTables:
    """cos and sin (fp32, [num_tokens, head_dim]) at this step's positions."""
    cos: torch.Tensor
    sin: torch.Tensor


def apply_rotary(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] -> rotated copy. The model's CPU path rotates inside the
    fused kernel that also fills the KV cache (layers/attention.py); this is its reference."""
    cos, sin = rope.cos.unsqueeze(1).to(x.dtype), rope.sin.unsqueeze(1).to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
