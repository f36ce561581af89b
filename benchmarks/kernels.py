"""Kernel microbenchmarks: paged attention at decode, and bf16 linear layers three ways.

    python benchmarks/kernels.py

Attention: 64 decoding sequences x 16 heads (4 KV heads) x 200, 600 and 1000 tokens of context,
head size 64, bf16, block size 16, blocks scattered: ms per layer call, best of 5, and the K/V
bytes read per second. Linear: weights 5632 x 1024 bf16, 8 matrices in turn so that they come
from memory, GFLOP/s for 1 to 2048 input rows of our Linear as the model runs it (packed for
oneDNN; up to ROWS_KERNEL_MAX rows, our kernel over the same packed weights), of oneDNN's GEMM
on the packed weights at every row count, and of F.linear on the plain weights.
"""
from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.linear import ROWS_KERNEL_MAX, Linear


def attention_case(seqs: int, context: int, block_size: int = 16, heads: int = 16, kv_heads: int = 4, d: int = 64):
    per_seq = -(-context // block_size)
    num_blocks = seqs * per_seq
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)
    k = torch.randn(num_blocks, block_size, kv_heads, d).bfloat16()
    v = torch.randn(num_blocks, block_size, kv_heads, d).bfloat16()
    tables = torch.tensor([order[i * per_seq:(i + 1) * per_seq] for i in range(seqs)], dtype=torch.int32)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), tables, torch.arange(seqs + 1, dtype=torch.int32),
                             torch.full((seqs,), context, dtype=torch.int32), [context] * seqs, [1] * seqs)
    return torch.randn(seqs, heads, d).bfloat16(), k, v, meta


def best_seconds(fn, repeats: int = 5, inner: int = 20) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def main() -> None:
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the C++ kernels are not available here")
    print("| paged attention, 64 decodes x 16 heads | ms a layer | K/V GB/s |")
    print("|---|---|---|")
    for context in (200, 600, 1000):
        q, k, v, meta = attention_case(64, context)
        out = torch.empty_like(q)
        seconds = best_seconds(lambda: ops.paged_attention(out, q, k, v, meta.block_tables, meta.query_start_loc,
                                                           meta.seq_lens, 0.125, 0, True))
        kv_bytes = 2 * 64 * context * k.shape[2] * k.shape[3] * k.element_size()
        print(f"| {context} tokens of context | {seconds * 1000:.2f} | {kv_bytes / seconds / 1e9:.1f} |")
    print()
    o, i = 5632, 1024
    plain = [Linear(i, o, bias=False).bfloat16() for _ in range(8)]
    packed = [Linear(i, o, bias=False).bfloat16() for _ in range(8)]
    for layer in packed:
        layer.pack()
    print(f"| input rows | Linear GFLOP/s (rows kernel up to {ROWS_KERNEL_MAX} rows) | oneDNN, packed GFLOP/s | "
          "F.linear GFLOP/s | Linear: weight GB/s |")
    print("|---|---|---|---|---|")
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048):
        x = torch.randn(rows, i).bfloat16()
        flops = 2 * rows * o * i * len(plain)
        ways = [lambda: [layer(x) for layer in packed],
                lambda: [torch.ops.mkldnn._linear_pointwise(x, layer.weight, None, "none", [], "") for layer in packed],
                lambda: [F.linear(x, layer.weight) for layer in plain]]
        with torch.inference_mode():
            seconds = [best_seconds(way, 5, 1) for way in ways]
        rates = " | ".join(f"{flops / s / 1e9:.0f}" for s in seconds)
        print(f"| {rows} | {rates} | {o * i * 2 * len(plain) / seconds[0] / 1e9:.1f} |")


if __name__ == "__main__":
    main()
