"""RMSNorm with Hugging Face's numerics (normalize in fp32, scale in the model dtype), fused with
the residual add before it where the C++ kernels are at hand."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import fused_ops_for


def _fused(x: torch.Tensor):
    ops = fused_ops_for(x)
    return ops if ops is not None and x.is_contiguous() else None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = _fused(x)
        if ops is not None:
            out = torch.empty_like(x)
            ops.rms_norm(out, x, None, self.weight, self.eps)
            return out
        return rms_norm_reference(x, self.weight, self.eps)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, its norm); the sum is written into `residual` when fused."""
        ops = _fused(residual)
        if ops is not None:
            out = torch.empty_like(residual)
            ops.rms_norm(out, residual, delta, self.weight, self.eps)
            return residual, out
        return add_rms_norm_reference(residual, delta, self.weight, self.eps)


# The torch paths, module functions so that --compile can swap them (layers/compile.py).
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def gemma_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm_reference(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + delta
    return residual, rms_norm_reference(residual, weight, eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1, and the scaling is done in fp32
    before the cast back (Llama's casts first, then scales in the model dtype)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = _fused(x)
        if ops is not None and self.weight.dtype == x.dtype:
            out = torch.empty_like(x)
            ops.gemma_rms_norm(out, x, self.weight, self.eps)
            return out
        return gemma_rms_norm_reference(x, self.weight, self.eps)
