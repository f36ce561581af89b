"""Rotary position embedding (neox / rotate-half layout, as Hugging Face Llama applies it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def _rope_params(config, layer_type: str | None) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    return dict(params[layer_type]) if layer_type is not None else params


def rotary_dim(config, head_dim: int, layer_type: str | None = None) -> int:
    """How many of a head's dims rotate (Phi-4-mini's partial_rotary_factor: the first 3/4)."""
    factor = _rope_params(config, layer_type).get(
        "partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0
    )
    return int(head_dim * factor)


def partial_rotary_order(head_dim: int, rotated: int) -> list[int]:
    """For partial rotary: the order of a head's dims that lets the full-width rotate-half rotation
    compute it. Each half of the head starts with its half of the rotated dims (rotate-half pairs
    dim i with dim i + head_dim / 2, a partial rotation pairs i with i + rotated / 2); the dims that
    do not rotate fill the rest, where the tables rotate by angle 0. q and k rows permuted alike
    leave every q.k, so attention, unchanged."""
    half, rotated_half = head_dim // 2, rotated // 2
    passing = list(range(rotated, head_dim))
    return (
        list(range(rotated_half))
        + passing[: half - rotated_half]
        + list(range(rotated_half, rotated))
        + passing[half - rotated_half :]
    )


def rope_inv_freq(
    config, head_dim: int, layer_type: str | None = None, max_positions: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (one per pair of rotated dims) and the cos/sin scale for the config's
    rope type (llama3, linear, yarn, longrope...). `layer_type`: for configs with rope parameters per
    kind of layer (Gemma 3's "sliding_attention" and "full_attention", each with its own base).
    LongRoPE takes its long factors when `max_positions` passes the original context (vLLM's
    choice, fixed for the engine; transformers switches per forward pass by the sequence's length)."""
    params = _rope_params(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = rotary_dim(config, head_dim, layer_type)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK rope scaling depends on the sequence length and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    extra = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "longrope":
        extra["seq_len"] = max_positions
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        self.config, self.head_dim, self.max_positions = config, head_dim, max_positions
        self.layer_type = layer_type
        # M-RoPE (Qwen2-VL): a head's rotated pairs fall in sections, each turned by its own of a
        # token's three positions (time, height, width); text tokens have all three equal.
        section = _rope_params(config, layer_type).get("mrope_section")
        self.mrope_stream = None if section is None else _mrope_streams(section, head_dim)
        self.build_tables("cpu")

    def build_tables(self, device: torch.device | str) -> None:
        # Computed on the CPU (the model may be under construction on "meta"; a rope type's inverse
        # frequencies come from transformers on the CPU), then moved: the same tables on any device.
        with torch.device("cpu"):
            inv_freq, scale = rope_inv_freq(self.config, self.head_dim, self.layer_type, self.max_positions)
            freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float), inv_freq)
            # Dims that do not rotate (partial rotary, in partial_rotary_order's layout): angle 0, unscaled.
            still = torch.zeros(self.max_positions, self.head_dim // 2 - freqs.shape[1])
            cos = torch.cat([freqs.cos() * scale, still.cos()], dim=-1)
            sin = torch.cat([freqs.sin() * scale, still.sin()], dim=-1)
        # [max_positions, head_dim]: cos and sin laid out for rotate-half.
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1).to(device), persistent=False)
        self.register_buffer("sin", torch.cat([sin, sin], dim=-1).to(device), persistent=False)

    def tables(self, positions: torch.Tensor) -> RopeTables:
        """positions: [tokens], or M-RoPE's [3, tokens] (each dim's angle from its section's row)."""
        if positions.dim() == 1:
            return RopeTables(self.cos[positions], self.sin[positions])
        if self.mrope_stream is None:
            raise ValueError("positions in three rows need a model with M-RoPE (rope_parameters' mrope_section)")
        rows = positions[
            self.mrope_stream.to(positions.device)
        ].T.contiguous()  # [tokens, head_dim]: each dim's position
        dims = torch.arange(self.head_dim, device=positions.device)
        return RopeTables(self.cos[rows, dims], self.sin[rows, dims])


def _mrope_streams(section: list[int], head_dim: int) -> torch.Tensor:
    """Which of the three position rows turns each of a head's dims (both halves alike)."""
    if sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section {section} must sum to half the head size ({head_dim // 2})")
    half = [i % 3 for i, size in enumerate(section) for _ in range(size)]
    return torch.tensor(half + half, device="cpu")  # (not on "meta", where the model is first built)


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
