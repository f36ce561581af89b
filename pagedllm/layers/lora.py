"""LoRA in a linear layer: `max_loras` slots of adapter weights beside the base weights, and each
step's rows' slots (LoRAContext), so that rows of different adapters and of the base model run in
one step. kernels/lora.cpp adds every row's x A^T B^T by its slot in one call a layer (each row on
its own, so outputs stay batch-invariant); `lora_add_reference` is the torch reference it is
tested against, and runs where the kernels do not.

A layer's slots: `a` [S, P * R, K], the A of each of its P parts (q, k and v; gate and up; one
part otherwise), part p's rows at p * R; `bt` [S, R, N], B transposed, each output column taking
its own part's B, in the column order the base method writes (a packed gate/up layer interleaves
its halves); in bf16, [S, R / 2, N, 2], rank rows 2i and 2i + 1 side by side (`pair_rank_rows`), the
pairs the bf16 dot-product instructions take. R is even. A slot's rank is its adapter's largest in
this layer; the rows past a part's own rank are zeros. Scaling is folded into B. The weights are in
the model's dtype, also beside a quantized base; bf16 rounds x A^T to bf16 before B, as PEFT does."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.kernels import cpu_ops
from pagedllm.layers.linear import KernelSpec, Linear, SiluAndMulLinear

# A module's update as loaded: A [rank, in], B [out, rank] (scaled), whole (before any
# tensor-parallel split), for a shard of the layer (None: the whole layer).
ShardUpdate = tuple[str | int | None, torch.Tensor, torch.Tensor]


class LoRAContext:
    """The step's rows' adapter slots, shared by every layer's LoRASlots. `row_slot`: int32
    [rows], -1 for the base model's rows; None when no row has an adapter. Where some rows have
    none, `lora_rows` lists the others (a gated MLP computes those apart: lora/layers.py)."""

    def __init__(self) -> None:
        self.row_slot: torch.Tensor | None = None
        self.lora_rows: torch.Tensor | None = None
        self.lora_row_slot: torch.Tensor | None = None
        ops = cpu_ops()
        # The same rows for the C++ decoder stack's adapter layers (kernels/lora.h).
        self.native = ops.LoRARows() if ops is not None else None

    @property
    def active(self) -> bool:
        return self.row_slot is not None

    def set_rows(self, row_slot: torch.Tensor | None) -> None:
        self.row_slot, self.lora_rows, self.lora_row_slot = row_slot, None, None
        if row_slot is not None:
            has = row_slot >= 0
            if not bool(has.all()):
                self.lora_rows = has.nonzero().squeeze(1)
                self.lora_row_slot = row_slot[self.lora_rows]
        if self.native is not None:
            self.native.set(row_slot, self.lora_rows, self.lora_row_slot)


@dataclass
class _Part:
    shard: str | int | None
    index: int


class LoRASlots:
    """One linear layer's adapter slots (see the module's docstring)."""

    def __init__(
        self, layer: Linear, ctx: LoRAContext, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.layer, self.ctx = layer, ctx
        self.max_rank = max_rank + max_rank % 2  # whole pairs of rank rows
        self.parts = {shard: i for i, shard in enumerate(layer.shards)}
        k, n = layer.in_features, layer.out_features
        self.a = torch.zeros(max_loras, len(self.parts) * self.max_rank, k, dtype=dtype, device=device)
        bt_shape = (self.max_rank // 2, n, 2) if dtype == torch.bfloat16 else (self.max_rank, n)
        self.bt = torch.zeros(max_loras, *bt_shape, dtype=dtype, device=device)
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)
        self.order = layer.method.product_order(layer)
        self.runs = self._runs()

    def _runs(self) -> torch.Tensor:
        """The output's columns, in the base method's order, as runs (first, end, part)."""
        part_of = torch.empty(self.layer.out_features, dtype=torch.int64)
        for shard, (first, count) in self.layer.shards.items():
            part_of[first : first + count] = self.parts[shard]
        if self.order is not None:
            part_of = part_of[self.order]
        runs, start = [], 0
        for c in range(1, len(part_of) + 1):
            if c == len(part_of) or part_of[c] != part_of[start]:
                runs.append((start, c, int(part_of[start])))
                start = c
        return torch.tensor(runs, dtype=torch.int64).view(-1, 3)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.bt.nbytes

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.ranks[slot] = 0

    def load(self, slot: int, updates: list[ShardUpdate]) -> None:
        """Put an adapter's updates of this layer into a slot (this rank's share of each)."""
        self.clear(slot)
        layer, r_max = self.layer, self.max_rank
        bt = torch.zeros(r_max, layer.out_features, dtype=torch.float32)
        for shard, a, b in updates:
            if layer.input_part is not None:
                a = a.narrow(1, *layer.input_part)
            rank = a.shape[0]
            # A whole-layer update of a fused layer (Phi-3's qkv_proj) is each part's: its A, its B's rows.
            for part in [shard] if shard is not None or len(self.parts) == 1 else list(self.parts):
                rows = b if shard is not None or part is None else b.narrow(0, *layer.parts[part])
                p = self.parts[part]
                self.a[slot, p * r_max : p * r_max + rank] = a.to(self.a.dtype)
                for local, source, count in layer.rows_of(part):
                    bt[:rank, local : local + count] = rows[source : source + count].T
            self.ranks[slot] = max(int(self.ranks[slot]), rank)
        bt = (bt if self.order is None else bt[:, self.order]).to(self.bt.dtype)
        self.bt[slot] = pair_rank_rows(bt) if self.bt.dim() == 4 else bt

    def add(self, out: torch.Tensor, x: torch.Tensor, row_slot: torch.Tensor | None = None) -> None:
        """out[r] += x[r] A^T B^T of row r's slot, in place (rows of slot -1 unchanged)."""
        row_slot = self.ctx.row_slot if row_slot is None else row_slot
        x = x.contiguous()
        ops = cpu_ops()
        if ops is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            ops.lora_add(out, x, self.a, self.bt, row_slot, self.ranks, self.runs)
        else:
            lora_add_reference(out, x, self.a, self.bt, row_slot, self.ranks, self.runs)

    def kernel_spec(self, base: KernelSpec) -> KernelSpec | None:
        """The layer as the C++ stack runs it: its method's op, then the update (kernels/lora.cpp's
        LoRALinear); None where its method has no unfused gate/up product for the stack."""
        product = None
        if isinstance(self.layer, SiluAndMulLinear):
            product = self.layer.method.product_kernel_spec(self.layer)
            if product is None:
                return None
        interleaved = self.order is not None
        args = (self.a, self.bt, self.ranks, self.runs, self.ctx.native)
        return cpu_ops().LoRALinear(base, product, interleaved, *args)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """A SiluAndMulLinear's output with the adapters' updates added to its gate/up product. Rows
        without an adapter take the base method's own (fused) path, as they would alone."""
        layer: SiluAndMulLinear = self.layer  # type: ignore[assignment]
        method, ctx = layer.method, self.ctx
        if ctx.lora_rows is None:
            product = method.apply_product(layer, x)
            self.add(product, x)
            return method.silu_of_product(layer, product)
        out = method.apply_silu_and_mul(layer, x)
        lora_x = x[ctx.lora_rows]
        product = method.apply_product(layer, lora_x)
        self.add(product, lora_x, ctx.lora_row_slot)
        out[ctx.lora_rows] = method.silu_of_product(layer, product)
        return out


def lora_add_reference(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    row_slot: torch.Tensor,
    ranks: torch.Tensor,
    runs: torch.Tensor,
) -> None:
    """kernels/lora.cpp's lora_add in torch: per slot, its rows' x A^T (rounded to bf16 in bf16), then
    B^T by runs, in fp32."""
    if bt.dim() == 4:
        bt = bt.transpose(2, 3).flatten(1, 2)
    max_rank = bt.shape[1]
    parts = a.shape[1] // max_rank
    for slot in sorted(set(row_slot.tolist()) - {-1}):
        rank = int(ranks[slot])
        if rank == 0:  # adds nothing: its rows left as they are, as the kernel leaves them
            continue
        rows = (row_slot == slot).nonzero().squeeze(1).to(out.device)
        t = (x[rows].float() @ a[slot].float().T).view(-1, parts, max_rank)[:, :, :rank]
        if x.dtype == torch.bfloat16:
            t = t.to(torch.bfloat16).float()
        delta = torch.zeros(len(rows), out.shape[1], dtype=torch.float32, device=out.device)
        for first, end, part in runs.tolist():
            delta[:, first:end] = t[:, part] @ bt[slot, :rank, first:end].float()
        out[rows] = (out[rows].float() + delta).to(out.dtype)


def pair_rank_rows(bt: torch.Tensor) -> torch.Tensor:
    """B^T [..., R, N] (R even) as [..., R / 2, N, 2]: rank rows 2i and 2i + 1 side by side, bf16's layout."""
    *lead, rank, n = bt.shape
    assert rank % 2 == 0, f"pairs of rank rows need an even rank, not {rank}"
    return bt.reshape(*lead, rank // 2, 2, n).transpose(-1, -2).contiguous()
