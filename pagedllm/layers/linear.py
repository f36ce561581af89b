"""Linear layers. On CPU, bf16 weights are reordered once, after loading, into oneDNN's blocked
layout: its GEMM then runs faster than on the plain [out, in] layout at every batch size measured
here (1.1x at 512 rows, 1.4x at 64, 1.8x at one row: benchmarks/kernels.py), with results
identical to F.linear's. Our own kernel reads that same packed copy: at a few rows, where a layer
is one pass over its weights, closer to the machine's memory bandwidth; up to 1024 rows, 1.04x
(256-1024 rows) to 1.4x (32 rows) oneDNN's GEMM on CPUs without AMX (Zen 4 here; one run of
benchmarks/kernels.py). A gated MLP's gate and up projections are one SiluAndMulLinear, whose
kernel path applies the activation as it stores."""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_ops
from pagedllm.layers.activation import silu_and_mul

# The batch size oneDNN chooses the blocked layout for; the layout serves every batch size.
PACK_BATCH_HINT = 128


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


# packed_linear_rows runs instead of oneDNN's GEMM (benchmarks/kernels.py) on at most this many
# rows a call: where oneDNN has AMX tiles, only while a layer is bound by memory (not measured
# here); elsewhere on every batch, in chunks of this many rows (2048 rows: 1.01-1.05x oneDNN).
ROWS_KERNEL_MAX = 8 if _cpu_has_amx() else 1024
ROWS_KERNEL_CHUNKS = ROWS_KERNEL_MAX > 8
_BLOCK_N, _BLOCK_K = 64, 32  # oneDNN's AB16b64a2b blocks, the layout the kernel reads


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


class Linear(nn.Linear):
    # (the packed weight, its buffer's address, padded out and in features) where the rows kernel can read it
    _rows: tuple[torch.Tensor, int, int, int] | None = None

    def pack(self) -> None:
        """Swap the weight for its packed copy (where oneDNN can take it); the plain one is freed."""
        if self.weight.layout == torch._mkldnn or not can_pack(self.weight):
            return
        self._pack(self.weight.detach())

    def _pack(self, plain: torch.Tensor) -> None:
        packed = torch.ops.mkldnn._reorder_linear_weight(plain, PACK_BATCH_HINT)
        self._rows = _rows_kernel_view(packed, plain)
        del self.weight
        self.register_buffer("weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # At batch 1 this runs 65 times a step on the 250M model: attribute lookups through
        # nn.Module (self.weight, self.bias) are kept off the kernel's path.
        if self._rows_kernel_takes(x):
            return self._packed_rows(x, False)
        return self._library_linear(x)

    def kernel_spec(self) -> tuple[torch.Tensor, int, int, int, int, torch.Tensor | None] | None:
        """(packed weight, its buffer's address, padded out and in features, out features, bias) for
        a C++ caller of the rows kernel (kernels/decoder_stack.cpp): where that kernel takes every
        batch size and its input needs no padding; else None."""
        rows = self._rows
        if (rows is None or not ROWS_KERNEL_CHUNKS or rows[3] != self.in_features
                or rows[0] is not self._buffers.get("weight")):
            return None
        return (*rows, self.out_features, self._parameters["bias"])

    def _rows_kernel_takes(self, x: torch.Tensor) -> bool:
        rows = self._rows
        # The kernel reads the packed buffer by address: only while that buffer is the weight.
        return (rows is not None and x.dim() == 2 and (x.shape[0] <= ROWS_KERNEL_MAX or ROWS_KERNEL_CHUNKS)
                and rows[0] is self._buffers.get("weight"))

    def _library_linear(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight.layout != torch._mkldnn:
            return F.linear(x, weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")

    def _packed_rows(self, x: torch.Tensor, silu_mul: bool) -> torch.Tensor:
        _, address, n_padded, k_padded = self._rows
        x = x.contiguous() if x.shape[1] == k_padded else F.pad(x, (0, k_padded - x.shape[1]))
        out = x.new_empty((x.shape[0], self.out_features // 2 if silu_mul else self.out_features))
        kernel, bias = cpu_ops().packed_linear_rows, self._parameters["bias"]
        if x.shape[0] <= ROWS_KERNEL_MAX:
            kernel(out, x, address, n_padded, k_padded, bias, silu_mul)
            return out
        for start in range(0, x.shape[0], ROWS_KERNEL_MAX):
            rows = slice(start, start + ROWS_KERNEL_MAX)
            kernel(out[rows], x[rows], address, n_padded, k_padded, bias, silu_mul)
        return out


class SiluAndMulLinear(Linear):
    """A gated MLP's gate and up projections as one layer, [.., in] -> silu(x Wg^T) * (x Wu^T),
    [.., out_features / 2]; its weight is gate's rows, then up's. Where the rows kernel can read
    it, the packed copy interleaves the two 64 rows at a time (the kernel's column blocks), and
    the kernel applies SiLU-and-mul as it stores each pair of blocks: the [.., out_features]
    product is never written, nor read back by a separate SiLU pass (at 2048 rows, 23 MB a layer
    each way). Results are those of silu_and_mul on the plain layer's output, bit for bit."""
    _interleaved = False

    def pack(self) -> None:
        n = self.out_features // 2
        ops = cpu_ops()
        if (self.weight.layout == torch._mkldnn or not can_pack(self.weight) or self.bias is not None
                or n % _BLOCK_N or ops is None or not ops.packed_linear_available()):
            return super().pack()
        self._pack(_interleave_halves(self.weight.detach(), _BLOCK_N))
        self._interleaved = True

    def kernel_spec(self) -> tuple[torch.Tensor, int, int, int, int, torch.Tensor | None] | None:
        """As Linear's, where the kernel can apply SiLU-and-mul (the halves interleaved)."""
        return super().kernel_spec() if self._interleaved else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._interleaved:
            return silu_and_mul(super().forward(x))
        if self._rows_kernel_takes(x):
            return self._packed_rows(x, True)
        out = self._library_linear(x)  # columns in the interleaved order
        return silu_and_mul(out.view(*out.shape[:-1], -1, 2, _BLOCK_N).transpose(-3, -2).reshape(out.shape))


def _interleave_halves(weight: torch.Tensor, group: int) -> torch.Tensor:
    """Rows [a; b] -> [a0; b0; a1; b1; ..], each piece `group` rows."""
    return weight.view(2, -1, group, weight.shape[1]).transpose(0, 1).reshape(weight.shape)


def _rows_kernel_view(packed: torch.Tensor, plain: torch.Tensor) -> tuple[torch.Tensor, int, int, int] | None:
    """What the rows kernel needs, if oneDNN chose the layout it reads (checked against the weights
    themselves: another CPU or oneDNN version may choose another); else None."""
    ops = cpu_ops()
    if ops is None or not ops.packed_linear_available():
        return None
    n, k = plain.shape
    n_padded, k_padded = -(-n // _BLOCK_N) * _BLOCK_N, -(-k // _BLOCK_K) * _BLOCK_K
    nbytes = torch.ops.mkldnn._nbytes(packed)
    if nbytes != n_padded * k_padded * plain.element_size():
        return None
    address = torch.ops.mkldnn.data_ptr(packed)
    raw = torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=plain.dtype)
    expected = F.pad(plain, (0, k_padded - k, 0, n_padded - n))
    expected = expected.view(n_padded // _BLOCK_N, _BLOCK_N, k_padded // _BLOCK_K, _BLOCK_K // 2, 2)
    if not torch.equal(raw, expected.permute(0, 2, 3, 1, 4).reshape(-1)):
        return None
    return packed, address, n_padded, k_padded


def pack_linears(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
