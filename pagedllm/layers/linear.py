"""Linear layers: a bf16 kernel for the skinny products of decode, oneDNN's GEMM otherwise."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_ops

# Up to this many rows the kernel beats oneDNN's GEMM on [out, in] weights here (1.5x at one row,
# even by 8; benchmarks/kernels.py); past it the GEMM's blocking wins.
MAX_KERNEL_ROWS = 8


@functools.cache
def _gemv():
    ops = cpu_ops()
    return ops.gemv_bf16 if ops is not None and ops.has_avx512_bf16() else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (x.dim() == 2 and x.shape[0] <= MAX_KERNEL_ROWS and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.device.type == "cpu" and x.shape[1] % 32 == 0 and weight.is_contiguous() and _gemv() is not None):
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
        _gemv()(out, x.contiguous(), weight)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
