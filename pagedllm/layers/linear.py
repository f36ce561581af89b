"""Linear layers. On CPU, bf16 weights are reordered once, after loading, into oneDNN's blocked
layout: its GEMM then runs faster than on the plain [out, in] layout at every batch size measured
here (1.1x at 512 rows, 1.4x at 64, 1.8x at one row: benchmarks/kernels.py), with results
identical to F.linear's."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The batch size oneDNN chooses the blocked layout for; the layout serves every batch size.
PACK_BATCH_HINT = 128


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


class Linear(nn.Linear):
    def pack(self) -> None:
        """Swap the weight for its packed copy (where oneDNN can take it); the plain one is freed."""
        if self.weight.layout == torch._mkldnn or not can_pack(self.weight):
            return
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_BATCH_HINT)
        del self.weight
        self.register_buffer("weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.layout == torch._mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
