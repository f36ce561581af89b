"""Linear layers and the methods behind them.

A layer knows its shape and which rows of its output each checkpoint shard fills (q/k/v in
QKVLinear, gate/up in SiluAndMulLinear); its *linear method* owns everything about the weights:
which parameters hold them (their shapes and dtypes are the method's), what happens to them once
loaded, how x W^T is computed, and whether the C++ decoder stack can run them (kernel_spec). Each
parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies one checkpoint
tensor in; a method's parameters keep the output's rows along dim 0, so that a shard is a range
of rows whatever its dtype (a quantized method's blocks of a row stay in that row).

Tensor parallelism (`parallel`): a "column" layer holds its rank's share of each shard's output
rows (of each of q, k and v, of gate and up), a "row" layer its rank's share of the input's
columns, and sums its output over the ranks (all-reduce); its bias is added once, by rank 0.
Sizes given to a layer are the whole model's; `in_features` and `out_features` are the rank's.

UnquantizedLinearMethod keeps plain [out, in] weights and calls F.linear (other devices, fp16).
On the CPU it hands the layer, once loaded, to PackedBF16LinearMethod where our rows kernel can
read oneDNN's packed bf16 weights (AVX512-BF16), else to BlockedLinearMethod (fp32; bf16 on other
CPUs). A quantized format is
one more LinearMethodBase, given to the layers as `method`.
"""

from __future__ import annotations

import ctypes
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallel, all_reduce, tensor_parallel
from pagedllm.kernels import cpu_ops
from pagedllm.layers.activation import silu_and_mul

# A shard's place in a fused layer: its first output row and its number of rows.
ShardRows = tuple[int, int]
WeightLoader = Callable[..., None]
# A linear layer as kernels/decoder_stack.cpp runs it: the C++ LinearOp its method builds
# (kernels/linear_op.h), callable from Python as op(x).
KernelSpec = object

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
_COLUMN_BLOCK = 16  # blocked_linear_rows' column blocks


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and _mkldnn_packs_bf16()


@functools.cache
def _mkldnn_packs_bf16() -> bool:
    """Whether oneDNN takes bf16 weights here: it needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and
    refuses on AVX2-only CPUs (where BlockedLinearMethod serves them)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(64, 64, dtype=torch.bfloat16), PACK_BATCH_HINT)
    except RuntimeError:
        return False
    return True


def copy_checked(dest: torch.Tensor, loaded: torch.Tensor) -> None:
    if dest.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)}, model expects {tuple(dest.shape)}")
    dest.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """For parameters that set no loader of their own (embeddings, norms)."""
    copy_checked(param.data, loaded)


def load_weight(param: torch.Tensor, loaded: torch.Tensor, shard: str | int | None, name: str) -> None:
    """A checkpoint tensor `name` into `param`, through the parameter's own loader (a linear layer's:
    by shard), else a plain checked copy; a mismatch names the tensor."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        if shard is None:
            loader(param, loaded)
        else:
            loader(param, loaded, shard)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc


class LinearMethodBase(ABC):
    """How a linear layer's weights are held and applied. Stateless: what a layer needs is set on
    the layer (parameters, buffers, attributes), so one method object may serve many layers."""

    @abstractmethod
    def create_weights(self, layer: Linear, weight_loader: WeightLoader) -> None:
        """Register the weight parameters on the layer (its bias, if any, is registered already),
        each with `weight_loader` as its loader unless the method loads it its own way."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Once every shard is in: repack, quantize, or hand the layer to another method."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> x W^T + b [rows, out]."""

    def apply_silu_and_mul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """A SiluAndMulLinear's output; a method that can fuse the activation overrides this."""
        return silu_and_mul(self.apply(layer, x))

    def kernel_spec(self, layer: Linear) -> KernelSpec | None:
        """The layer as the C++ decoder stack takes it; None where the stack has no kernel for it."""
        return None

    # A gated MLP's gate/up product taken apart, for LoRA (layers/lora.py), which adds its update
    # to the product before the activation:
    def apply_product(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """A SiluAndMulLinear's gate/up product, its columns in `product_order`."""
        return self.apply(layer, x)

    def product_order(self, layer: Linear) -> torch.Tensor | None:
        """The layer's output column each column of `apply_product` holds; None: in order."""
        return None

    def silu_of_product(self, layer: Linear, product: torch.Tensor) -> torch.Tensor:
        """SiLU-and-mul of an `apply_product` result: what apply_silu_and_mul returns, bit for bit."""
        return silu_and_mul(product)

    def product_kernel_spec(self, layer: Linear) -> KernelSpec | None:
        """`apply_product` as a C++ op for the stack; None where there is none."""
        return None


class UnquantizedLinearMethod(LinearMethodBase):
    """Plain [out, in] weights in the model's dtype, applied by F.linear (other devices, fp16);
    on the CPU, bf16 and fp32 weights are packed for kernels of our own once loaded."""

    def create_weights(self, layer: Linear, weight_loader: WeightLoader) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features))
        layer.weight.weight_loader = weight_loader
        # nn.Linear's random draw, weight then bias, so that a layer built alone (tests,
        # benchmarks) holds its numbers; a model built on the meta device draws nothing.
        nn.Linear.reset_parameters(layer)

    def process_weights_after_loading(self, layer: Linear) -> None:
        # Decided here, not at construction: the model is built on the meta device and only then
        # given its device and dtype. Elsewhere the plain weights stay.
        # bf16 goes to oneDNN's layout (which hands it on to the blocked kernel where our rows
        # kernel cannot read it); fp32, and bf16 where oneDNN will not pack, to the blocked kernel.
        if can_pack(layer.weight):
            layer.method = PackedBF16LinearMethod()
        elif _blocked_kernel_takes(layer.weight):
            layer.method = BlockedLinearMethod()
        else:
            return
        layer.method.process_weights_after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class PackedBF16LinearMethod(UnquantizedLinearMethod):
    """bf16 weights on the CPU, reordered once after loading into oneDNN's blocked layout: its GEMM
    then runs faster than on the plain [out, in] layout at every batch size measured here (1.1x at
    512 rows, 1.4x at 64, 1.8x at one row: benchmarks/kernels.py), with results identical to
    F.linear's. Our own kernel reads that same packed copy: at a few rows, where a layer is one
    pass over its weights, closer to the machine's memory bandwidth; up to 1024 rows, 1.04x
    (256-1024 rows) to 1.4x (32 rows) oneDNN's GEMM on CPUs without AMX (Zen 4 here; one run of
    benchmarks/kernels.py).

    A SiluAndMulLinear's packed copy interleaves gate and up 64 rows at a time (the kernel's
    column blocks), and the kernel applies SiLU-and-mul as it stores each pair of blocks: the
    [.., 2n] product is never written, nor read back by a separate SiLU pass (at 2048 rows, 23 MB
    a layer each way). Results are those of silu_and_mul on the plain product, bit for bit.

    Per layer it sets `_rows` (the packed weight, its buffer's address, padded out and in
    features, where the rows kernel can read it; else None) and, on a SiluAndMulLinear,
    `_interleaved`. Weights are as UnquantizedLinearMethod creates and loads them."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        plain = layer.weight.detach()
        if isinstance(layer, SiluAndMulLinear) and _can_interleave(layer):
            plain = _interleave_halves(plain, _BLOCK_N)
            layer._interleaved = True
        packed = torch.ops.mkldnn._reorder_linear_weight(plain, PACK_BATCH_HINT)
        layer._rows = _rows_kernel_view(packed, plain)
        # No AVX512-BF16 rows kernel, or a layout it does not read: the blocked kernel, where built
        # (oneDNN's GEMM alone is not batch-invariant and has no place in the C++ stack).
        if layer._rows is None and _blocked_kernel_takes(plain):
            layer._interleaved = False
            layer.method = BlockedLinearMethod()
            layer.method.process_weights_after_loading(layer)
            return
        del layer.weight  # the plain copy is freed (a tied embedding keeps its own)
        layer.register_buffer("weight", packed, persistent=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if _rows_kernel_takes(layer, x):
            return _packed_rows(layer, x, False)
        return _library_linear(layer, x)

    def apply_silu_and_mul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if not layer._interleaved:
            return silu_and_mul(self.apply(layer, x))
        if _rows_kernel_takes(layer, x):
            return _packed_rows(layer, x, True)
        return self.silu_of_product(layer, _library_linear(layer, x))  # columns in the interleaved order

    def product_order(self, layer: Linear) -> torch.Tensor | None:
        if not layer._interleaved:
            return None
        return _interleave_halves(torch.arange(layer.out_features).view(-1, 1), _BLOCK_N).view(-1)

    def silu_of_product(self, layer: Linear, product: torch.Tensor) -> torch.Tensor:
        if not layer._interleaved:
            return silu_and_mul(product)
        halves = product.view(*product.shape[:-1], -1, 2, _BLOCK_N).transpose(-3, -2).reshape(product.shape)
        return silu_and_mul(halves)

    def kernel_spec(self, layer: Linear) -> KernelSpec | None:
        """Where the rows kernel takes every batch size, its input needs no padding, and (on a
        SiluAndMulLinear) the halves are interleaved, as the stack applies SiLU-and-mul."""
        rows = layer._rows
        silu_mul = isinstance(layer, SiluAndMulLinear)
        if (
            rows is None
            or not ROWS_KERNEL_CHUNKS
            or rows[3] != layer.in_features
            or rows[0] is not layer._buffers.get("weight")
            or silu_mul
            and not layer._interleaved
        ):
            return None
        return cpu_ops().PackedLinear(*rows, layer.out_features, layer._parameters["bias"], silu_mul, ROWS_KERNEL_MAX)

    def product_kernel_spec(self, layer: Linear) -> KernelSpec | None:
        if self.kernel_spec(layer) is None:
            return None
        return cpu_ops().PackedLinear(
            *layer._rows, layer.out_features, layer._parameters["bias"], False, ROWS_KERNEL_MAX
        )


class BlockedLinearMethod(UnquantizedLinearMethod):
    """fp32 weights on the CPU, and bf16 ones where our AVX512-BF16 rows kernel is not built, packed
    once into 16-column blocks [N / 16, K, 16] for kernels/packed_linear.cpp's blocked_linear_rows:
    each output one chain of fused multiply-adds in fp32, in k order, whatever rows share the call,
    so that outputs are batch-invariant (F.linear's GEMM sums in an order that depends on the
    call's rows). A row-parallel layer's share comes out in fp32, rounded once the ranks' shares
    are added (Linear.forward)."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        plain = layer.weight.detach()
        n, k = plain.shape
        n_padded = -(-n // _COLUMN_BLOCK) * _COLUMN_BLOCK
        packed = F.pad(plain, (0, 0, 0, n_padded - n)).view(-1, _COLUMN_BLOCK, k).transpose(1, 2).contiguous()
        del layer.weight  # the plain copy is freed (a tied embedding keeps its own)
        layer.register_buffer("weight", packed, persistent=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.in_features).contiguous()
        dtype = torch.float32 if layer.reduce_results else x.dtype
        out = rows.new_empty((rows.shape[0], layer.out_features), dtype=dtype)
        cpu_ops().blocked_linear_rows(out, rows, layer.weight, layer._parameters["bias"])
        return out.view(*x.shape[:-1], layer.out_features)

    def kernel_spec(self, layer: Linear) -> KernelSpec | None:
        """The same kernel; on a SiluAndMulLinear, followed by silu_and_mul, as apply_silu_and_mul."""
        silu_mul = isinstance(layer, SiluAndMulLinear)
        return cpu_ops().BlockedLinear(layer.weight, layer.out_features, layer._parameters["bias"], silu_mul)

    def product_kernel_spec(self, layer: Linear) -> KernelSpec | None:
        return cpu_ops().BlockedLinear(layer.weight, layer.out_features, layer._parameters["bias"], False)


def _blocked_kernel_takes(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and cpu_ops() is not None


class Linear(nn.Module):
    """[.., in] -> [.., out], computed by its method (UnquantizedLinearMethod unless given one).
    `parts`: the checkpoint shards it fuses, with their rows (None: one, loaded whole). Column
    parallelism: `shares`, the (first row, rows) of each part this rank holds (default: an even
    split); row parallelism: `input_share`, the input columns it holds (default: an even split)."""

    # Shard id -> this rank's output rows that checkpoint shard fills; {None: all} for a layer of one shard.
    shards: dict[str | int | None, ShardRows] = {}
    # Its LoRA adapters' slots (layers/lora.py's LoRASlots), where the worker serves adapters.
    lora: Any = None
    # PackedBF16LinearMethod: gate and up interleaved in the packed weight (a SiluAndMulLinear's only).
    _interleaved = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        method: LinearMethodBase | None = None,
        parallel: str | None = None,
        parts: dict[str | int | None, int] | None = None,
        shares: dict[str | int | None, ShardRows] | None = None,
        input_share: ShardRows | None = None,
    ) -> None:
        super().__init__()
        tp = tensor_parallel() if parallel is not None else TensorParallel()
        parts = parts or {None: out_features}
        # Per shard: its rows in the whole layer, and the first of them this rank holds.
        self.parts: dict[str | int | None, ShardRows] = {}
        self.sources: dict[str | int | None, int] = {}
        self.shards, start, local = {}, 0, 0
        for shard, rows in parts.items():
            first, count = (0, rows) if parallel != "column" else shares[shard] if shares else tp.split(rows)
            self.parts[shard], self.sources[shard], self.shards[shard] = (start, rows), first, (local, count)
            start, local = start + rows, local + count
        # Row parallelism: the input columns this rank holds, and its output summed over the ranks.
        self.input_part = (input_share or tp.split(in_features)) if parallel == "row" and tp.size > 1 else None
        self.input_whole = in_features
        self.reduce_results, self.tp_rank = self.input_part is not None, tp.rank
        self.in_features = self.input_part[1] if self.input_part else in_features
        self.out_features = local
        self.method = method or UnquantizedLinearMethod()
        self.register_parameter("bias", nn.Parameter(torch.empty(self.out_features)) if bias else None)
        if bias:
            self.bias.weight_loader = self.weight_loader
        self.method.create_weights(self, self.weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # At batch 1 this runs 65 times a step on the 250M model: one call into the method, which
        # keeps nn.Module's attribute lookups off the kernel's path.
        out = self.method.apply(self, x)
        if self.lora is not None and self.lora.ctx.row_slot is not None:
            self.lora.add(out, x)  # (a row-parallel share: each rank adds its columns' share)
        if not self.reduce_results:
            return out
        # The ranks' shares added in fp32 and rounded once (where the rows kernel ran: it leaves
        # them unrounded; oneDNN's GEMM has rounded them to bf16 already).
        return all_reduce(out.float()).to(x.dtype)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        """Copy a checkpoint tensor into `param`: all of it, or the rows of one shard; of each, this
        rank's share (a row-parallel bias: rank 0's whole, the others' zero)."""
        if self.input_part is not None:
            if param.dim() == 1:
                loaded = loaded if self.tp_rank == 0 else torch.zeros_like(loaded)
            elif loaded.dim() == 2 and loaded.shape[1] == self.input_whole:
                loaded = loaded.narrow(1, *self.input_part)
            elif loaded.dim() == 2:
                raise ValueError(
                    f"checkpoint shape {tuple(loaded.shape)}, model expects {self.input_whole} input columns"
                )
        whole = self.whole_rows(shard_id)
        if loaded.shape[0] != whole:
            columns = () if param.dim() == 1 else (self.input_whole,)
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)}, model expects {(whole, *columns)}")
        for local, source, rows in self.rows_of(shard_id):
            copy_checked(param.data.narrow(0, local, rows), loaded.narrow(0, source, rows))

    def whole_rows(self, shard_id: str | int | None) -> int:
        """The rows of a checkpoint tensor of `shard_id` (None: of the whole layer)."""
        return sum(rows for _, rows in self.parts.values()) if shard_id is None else self.parts[shard_id][1]

    def rows_of(self, shard_id: str | int | None) -> list[tuple[int, int, int]]:
        """Where a checkpoint tensor of `shard_id` (None: the whole layer) goes on this rank: per
        shard, (its first row here, the row of the tensor it starts at, rows)."""
        pieces = []
        for shard in [shard_id] if shard_id is not None else list(self.shards):
            offset = self.parts[shard][0] if shard_id is None else 0
            local, rows = self.shards[shard]
            pieces.append((local, offset + self.sources[shard], rows))
        return pieces

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def kernel_spec(self) -> KernelSpec | None:
        spec = self.method.kernel_spec(self)
        return spec if spec is None or self.lora is None else self.lora.kernel_spec(spec)


class QKVLinear(Linear):
    """Attention's q, k and v projections as one layer, [.., in] -> [.., q_size + 2 kv_size];
    the checkpoint's q_proj, k_proj and v_proj are its shards "q", "k" and "v"."""

    def __init__(
        self,
        in_features: int,
        q_size: int,
        kv_size: int,
        bias: bool,
        method: LinearMethodBase | None = None,
        parallel: str | None = None,
        shares: dict[str, ShardRows] | None = None,
    ) -> None:
        super().__init__(
            in_features, q_size + 2 * kv_size, bias, method, parallel, {"q": q_size, "k": kv_size, "v": kv_size}, shares
        )


class GateUpLinear(Linear):
    """A gated MLP's gate and up projections as one layer, [.., in] -> [.., out_features]: gate's
    outputs, then up's; the checkpoint's gate_proj and up_proj are its shards 0 and 1."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        method: LinearMethodBase | None = None,
        parallel: str | None = None,
    ) -> None:
        super().__init__(
            in_features, out_features, bias, method, parallel, {0: out_features // 2, 1: out_features // 2}
        )


class SiluAndMulLinear(GateUpLinear):
    """GateUpLinear with SiLU-and-mul applied: [.., in] -> silu(x Wg^T) * (x Wu^T), [.., out_features / 2]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None and self.lora.ctx.row_slot is not None:
            return self.lora.silu_and_mul(x)
        return self.method.apply_silu_and_mul(self, x)


def process_linear_weights(model: nn.Module) -> None:
    """Every linear layer's post-load step (packing, for the bf16 CPU method)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading()


def _can_interleave(layer: SiluAndMulLinear) -> bool:
    """Whether the rows kernel can apply SiLU-and-mul: halves of whole column blocks, no bias."""
    ops = cpu_ops()
    return (
        layer.out_features // 2 % _BLOCK_N == 0
        and layer.bias is None
        and ops is not None
        and ops.packed_linear_available()
    )


def _interleave_halves(weight: torch.Tensor, group: int) -> torch.Tensor:
    """Rows [a; b] -> [a0; b0; a1; b1; ..], each piece `group` rows."""
    return weight.view(2, -1, group, weight.shape[1]).transpose(0, 1).reshape(weight.shape)


@functools.cache
def rows_kernel_reads_onednn_layout() -> bool:
    """Whether bf16 layers here keep oneDNN's packed weights for our rows kernel: where it is built
    and oneDNN packs in the layout it reads (with AMX tiles oneDNN picks 32-column blocks, and the
    layers go to BlockedLinearMethod)."""
    if not _mkldnn_packs_bf16():
        return False
    probe = (torch.arange(_BLOCK_N * _BLOCK_K) % 251).view(_BLOCK_N, _BLOCK_K).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(probe, PACK_BATCH_HINT)
    return _rows_kernel_view(packed, probe) is not None


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


def _rows_kernel_takes(layer: Linear, x: torch.Tensor) -> bool:
    rows = layer._rows
    # The kernel reads the packed buffer by address: only while that buffer is the weight.
    return (
        rows is not None
        and x.dim() == 2
        and (x.shape[0] <= ROWS_KERNEL_MAX or ROWS_KERNEL_CHUNKS)
        and rows[0] is layer._buffers.get("weight")
    )


def _library_linear(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    weight = layer.weight
    if weight.layout != torch._mkldnn:
        return F.linear(x, weight, layer.bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, layer.bias, "none", [], "")


def _packed_rows(layer: Linear, x: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    _, address, n_padded, k_padded = layer._rows
    x = x.contiguous() if x.shape[1] == k_padded else F.pad(x, (0, k_padded - x.shape[1]))
    # A row-parallel layer's share stays in fp32 until the ranks' shares are added (Linear.forward).
    dtype = torch.float32 if layer.reduce_results and not silu_mul else x.dtype
    out = x.new_empty((x.shape[0], layer.out_features // 2 if silu_mul else layer.out_features), dtype=dtype)
    kernel, bias = cpu_ops().packed_linear_rows, layer._parameters["bias"]
    if x.shape[0] <= ROWS_KERNEL_MAX:
        kernel(out, x, address, n_padded, k_padded, bias, silu_mul)
        return out
    for start in range(0, x.shape[0], ROWS_KERNEL_MAX):
        rows = slice(start, start + ROWS_KERNEL_MAX)
        kernel(out[rows], x[rows], address, n_padded, k_padded, bias, silu_mul)
    return out
