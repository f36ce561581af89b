"""Kernel microbenchmarks: paged attention at decode, and skinny bf16 linear vs oneDNN.

    python benchmarks/kernels.py

Attention: 64 decoding sequences x 16 heads (4 KV heads) x 200 tokens of context, head size 64,
bf16, block size 16, blocks scattered: ms per layer call, best of 5. Linear: weights 5632 x 1024
bf16, 8 matrices in turn so that they come from memory, GFLOP/s of our kernel and of F.linear
for 1 to 128 input rows.
"""
from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import AttentionMetadata


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
    q, k, v, meta = attention_case(64, 200)
    out = torch.empty_like(q)
    seconds = best_seconds(lambda: ops.paged_attention(out, q, k, v, meta.block_tables, meta.query_start_loc,
                                                       meta.seq_lens, 0.125, 0, True))
    print(f"paged attention, 64 decodes x 16 heads x 200 tokens: {seconds * 1000:.2f} ms a layer\n")
    o, i = 5632, 1024
    weights = [torch.randn(o, i).bfloat16() for _ in range(8)]
    print("| input rows | ours GFLOP/s | F.linear GFLOP/s |")
    print("|---|---|---|")
    for rows in (1, 4, 8, 16, 32, 64, 128):
        x = torch.randn(rows, i).bfloat16()
        y = torch.empty(rows, o, dtype=torch.bfloat16)
        flops = 2 * rows * o * i * len(weights)
        ours = flops / best_seconds(lambda: [ops.gemv_bf16(y, x, w) for w in weights], 3, 1) / 1e9
        theirs = flops / best_seconds(lambda: [F.linear(x, w) for w in weights], 3, 1) / 1e9
        print(f"| {rows} | {ours:.0f} | {theirs:.0f} |")


if __name__ == "__main__":
    main()
