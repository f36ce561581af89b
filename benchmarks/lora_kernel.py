"""The batched LoRA kernel (kernels/lora.cpp's lora_add) on the 250M benchmark model's layers.

    .venv/bin/python benchmarks/lora_kernel.py --rounds 5

One decoder layer's four adapter layers (qkv, o, gate_up, down; hidden 1024, 16/4 heads of 64,
intermediate 2816) at rank 16 on every target, 8 adapter slots. For 1 row (batch-1 decode), 4 rows
of one adapter and 64 rows spread over the 8, it times, in one process, interleaved:
  - `kernel`: lora_add, every layer's update in one call a layer;
  - `per adapter`: the same updates as torch's matmuls in the same dtype, a shrink and an expansion
    per adapter per layer part (what the kernel replaces);
  - `base`: the layers' own bf16 products (F.linear), what the update is added to.
Prints each case's medians (range) in microseconds and the kernel's cost as a share of the base's.
Then a batch-1 decode step's 64 linear layers (16 of each, distinct weights, as the model runs them,
so that the adapters' weights come from memory, not the caches) with and without the updates.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import common  # noqa: F401 - sets the benchmarks' environment
from pagedllm.kernels import cpu_ops
from pagedllm.layers import lora as lora_layers

# (name, in features, out features, parts): the 250M model's adapter layers, gate/up in one.
LAYERS = (("qkv", 1024, 1536, 3), ("o", 1024, 1024, 1), ("gate_up", 1024, 5632, 2), ("down", 2816, 1024, 1))


def make_layer(k: int, n: int, parts: int, slots: int, rank: int, dtype: torch.dtype, g: torch.Generator):
    """A layer's slots: A, B^T, B^T in the kernel's layout (bf16's in pairs of rank rows where this
    tree has them), ranks, runs, and the base weight."""
    a = (torch.randn(slots, parts * rank, k, generator=g) * 0.02).to(dtype)
    bt = (torch.randn(slots, rank, n, generator=g) * 0.02).to(dtype)
    pair = getattr(lora_layers, "pair_rank_rows", None)
    kernel_bt = pair(bt) if dtype == torch.bfloat16 and pair is not None else bt
    width = n // parts
    runs = torch.tensor([[p * width, (p + 1) * width if p < parts - 1 else n, p] for p in range(parts)])
    weight = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
    return a, bt, kernel_bt, torch.full((slots,), rank, dtype=torch.int64), runs, weight


def per_adapter(out: torch.Tensor, x: torch.Tensor, a, bt, row_slot: torch.Tensor, runs: torch.Tensor) -> None:
    rank = bt.shape[1]
    for slot in row_slot.unique().tolist():
        rows = (row_slot == slot).nonzero().squeeze(1)
        t = x[rows] @ a[slot].T
        for first, end, part in runs.tolist():
            out[rows, first:end] += t[:, part * rank : (part + 1) * rank] @ bt[slot, :, first:end]


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def decode_step(ops, dtype: torch.dtype, args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    """A batch-1 decode step's linear layers as the model runs them: 16 layers of distinct weights,
    each base product followed by its update, so that the adapters' weights come from memory (the
    base weights' stream evicts them from the caches), against the base products alone."""
    g = torch.Generator().manual_seed(1)
    stack = [make_layer(k, n, parts, args.slots, args.rank, dtype, g) for _ in range(16) for _, k, n, parts in LAYERS]
    row_slot = torch.zeros(1, dtype=torch.int32)
    xs = {k: torch.randn(1, k, generator=g).to(dtype) for _, k, _, _ in LAYERS}

    def base():
        for layer in stack:
            F.linear(xs[layer[0].shape[2]], layer[-1])

    def adapted():
        for a, _, bt, ranks, runs, weight in stack:
            x = xs[a.shape[2]]
            ops.lora_add(F.linear(x, weight), x, a, bt, row_slot, ranks, runs)

    for _ in range(args.rounds):
        for name, fn in (("base", base), ("base + update", adapted)):
            times.setdefault(f"decode step, 16 layers: {name}", []).append(timed(fn, max(3, args.repeats // 10)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    ops = cpu_ops()
    assert ops is not None, "the C++ kernels did not build"
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    layers = [make_layer(k, n, parts, args.slots, args.rank, dtype, g) for _, k, n, parts in LAYERS]
    cases = {
        "1 row": torch.zeros(1, dtype=torch.int32),
        "4 rows, one adapter": torch.zeros(4, dtype=torch.int32),
        f"64 rows, {args.slots} adapters": (torch.arange(64) % args.slots).to(torch.int32),
    }
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for case, row_slot in cases.items():
            xs = [torch.randn(len(row_slot), k, generator=g).to(dtype) for _, k, _, _ in LAYERS]
            outs = [torch.zeros(len(row_slot), n, dtype=dtype) for _, _, n, _ in LAYERS]

            def kernel():
                for x, out, (a, _, bt, ranks, runs, _) in zip(xs, outs, layers):
                    ops.lora_add(out, x, a, bt, row_slot, ranks, runs)

            def matmuls():
                for x, out, (a, bt, _, _, runs, _) in zip(xs, outs, layers):
                    per_adapter(out, x, a, bt, row_slot, runs)

            def base():
                for x, layer in zip(xs, layers):
                    F.linear(x, layer[-1])

            for name, fn in (("kernel", kernel), ("per adapter", matmuls), ("base", base)):
                times.setdefault(f"{case}: {name}", []).append(timed(fn, args.repeats))
    decode_step(ops, dtype, args, times)
    print(f"medians of {args.rounds} rounds (range), microseconds for one layer's 4 adapter layers, {args.dtype}:")
    for key, values in times.items():
        print(f"  {key}: {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
    step = [
        a / b for a, b in zip(times["decode step, 16 layers: base"], times["decode step, 16 layers: base + update"])
    ]
    print(f"  decode step: base / (base + update) {statistics.median(step):.3f} ({min(step):.3f}-{max(step):.3f})")
    for case in cases:
        share = [k / b for k, b in zip(times[f"{case}: kernel"], times[f"{case}: base"])]
        speedup = [p / k for k, p in zip(times[f"{case}: kernel"], times[f"{case}: per adapter"])]
        print(
            f"  {case}: kernel / base {statistics.median(share):.3f} ({min(share):.3f}-{max(share):.3f}); "
            f"per adapter / kernel {statistics.median(speedup):.2f} ({min(speedup):.2f}-{max(speedup):.2f})"
        )


if __name__ == "__main__":
    main()
