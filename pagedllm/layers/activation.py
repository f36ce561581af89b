"""The gated MLP's activations: SiLU-and-mul (fused where the C++ kernels are at hand) and
GELU(tanh)-and-mul (Gemma's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels import fused_ops_for


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[.., 2n] -> [.., n]: silu(first half) * second half."""
    n = gate_up.shape[-1] // 2
    ops = fused_ops_for(gate_up)
    if ops is None or not gate_up.is_contiguous():
        return silu_and_mul_reference(gate_up)
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype, device=gate_up.device)
    ops.silu_and_mul(out, gate_up)
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[.., 2n] -> [.., n]: gelu(first half, tanh approximation) * second half (Gemma's MLP)."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
