"""Kernel microbenchmarks: paged attention at decode, and bf16 linear layers three ways.

    python benchmarks/kernels.py

Attention: 64 decoding sequences x 16 heads (4 KV heads) x 200, 600 and 1000 tokens of context,
head size 64, bf16, block size 16, blocks scattered: ms per layer call, best of 5, and the K/V
bytes read per second; then the same with an fp8 (e4m3) cache, the bf16 cache's time over its; then a
speculative verification's few query tokens walking their context together against one walk each.
Linear: the 250M model's four layer shapes, four of each (88 MB of bf16
weights), in turn so that they come from memory; GFLOP/s for 1 to 2048 input rows of our Linear
as the model runs it (packed for oneDNN; our kernel over the same packed weights, at most
ROWS_KERNEL_MAX rows a call), of oneDNN's GEMM on the packed weights at every row count, and of
F.linear on the plain weights; the three are timed in turn, seven rounds, and the median round
is reported. Our kernel's rate is also given as a share of this machine's bf16 arithmetic peak
(`common.measure_bf16_dot_peak_gflops`: dot-product instructions alone, on as many threads),
measured just before the table.
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from common import measure_bf16_dot_peak_gflops
from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.linear import ROWS_KERNEL_MAX, Linear


def attention_case(
    seqs: int,
    context: int,
    block_size: int = 16,
    heads: int = 16,
    kv_heads: int = 4,
    d: int = 64,
    prompts: bool = False,
):
    """Decodes (one query token a sequence) or, with prompts, whole prompts of `context` tokens."""
    per_seq = -(-context // block_size)
    num_blocks = seqs * per_seq
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)
    k = torch.randn(num_blocks, block_size, kv_heads, d).bfloat16()
    v = torch.randn(num_blocks, block_size, kv_heads, d).bfloat16()
    tables = torch.tensor([order[i * per_seq : (i + 1) * per_seq] for i in range(seqs)], dtype=torch.int32)
    q_len = context if prompts else 1
    meta = AttentionMetadata(
        torch.zeros(0, dtype=torch.long),
        tables,
        torch.arange(0, seqs * q_len + 1, q_len, dtype=torch.int32),
        torch.full((seqs,), context, dtype=torch.int32),
        [context] * seqs,
        [q_len] * seqs,
    )
    return torch.randn(seqs * q_len, heads, d).bfloat16(), k, v, meta


def best_seconds(fn, repeats: int = 5, inner: int = 20) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def verification(ops) -> None:
    """A speculative verification at batch 1 on the default model's heads (9, 3 KV heads, 64
    dims): its k + 1 query tokens walking their context together (one call),
    against each token walking alone (a decode call each, as a run's tokens were computed before)."""
    print(
        "| verification, 9 heads (3 KV), 700 tokens of context | tokens | together ms a layer | "
        "one walk each ms | alone / together |"
    )
    print("|---|---|---|---|---|")
    for tokens in (2, 5, 7):
        q, k, v, meta = attention_case(1, 700, heads=9, kv_heads=3)
        q = torch.randn(tokens, 9, 64).bfloat16()
        out = torch.empty_like(q)
        qsl = torch.tensor([0, tokens], dtype=torch.int32)
        ends = [torch.tensor([700 - tokens + 1 + t], dtype=torch.int32) for t in range(tokens)]
        one = torch.tensor([0, 1], dtype=torch.int32)
        rows = [(q[t : t + 1], out[t : t + 1].clone()) for t in range(tokens)]
        ways = [
            lambda: ops.paged_attention(out, q, k, v, meta.block_tables, qsl, meta.seq_lens, 0.125, 0, 1.0, 1.0),
            lambda: [
                ops.paged_attention(o, r, k, v, meta.block_tables, one, end, 0.125, 0, 1.0, 1.0)
                for (r, o), end in zip(rows, ends)
            ],
        ]
        times = [float("inf")] * 2
        for _ in range(3):  # alternated
            times = [min(t, best_seconds(way)) for t, way in zip(times, ways)]
        print(f"| | {tokens} | {times[0] * 1000:.3f} | {times[1] * 1000:.3f} | {times[1] / times[0]:.2f} |")
    print()


def main() -> None:
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the C++ kernels are not available here")
    print("| paged attention, 64 decodes x 16 heads | ms a layer | K/V GB/s |")
    print("|---|---|---|")
    for context in (200, 600, 1000):
        q, k, v, meta = attention_case(64, context)
        out = torch.empty_like(q)
        seconds = best_seconds(
            lambda: ops.paged_attention(
                out, q, k, v, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125, 0, 1.0, 1.0
            )
        )
        kv_bytes = 2 * 64 * context * k.shape[2] * k.shape[3] * k.element_size()
        print(f"| {context} tokens of context | {seconds * 1000:.2f} | {kv_bytes / seconds / 1e9:.1f} |")
    print()
    print("| paged attention, 64 decodes x 16 heads | bf16 cache ms | fp8 cache ms | bf16 / fp8 |")
    print("|---|---|---|---|")
    for context in (200, 600, 1000, 2000):
        q, k, v, meta = attention_case(64, context)
        k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        out = torch.empty_like(q)
        times = {}
        for _ in range(3):  # alternated: the machine's bandwidth drifts
            for name, (kc, vc) in (("bf16", (k, v)), ("fp8", (k8, v8))):
                seconds = best_seconds(
                    lambda: ops.paged_attention(
                        out,
                        q,
                        kc,
                        vc,
                        meta.block_tables,
                        meta.query_start_loc,
                        meta.seq_lens,
                        0.125,
                        0,
                        1.0,
                        1.0,
                    )
                )
                times[name] = min(times.get(name, seconds), seconds)
        print(
            f"| {context} tokens of context | {times['bf16'] * 1000:.2f} | {times['fp8'] * 1000:.2f} | "
            f"{times['bf16'] / times['fp8']:.2f} |"
        )
    print()
    verification(ops)
    print("| paged attention, whole prompts x 16 heads | ms a layer | GFLOP/s (causal: QK and PV of each pair) |")
    print("|---|---|---|")
    for seqs, length in ((16, 128), (1, 1024), (1, 2048)):
        q, k, v, meta = attention_case(seqs, length, prompts=True)
        out = torch.empty_like(q)
        seconds = best_seconds(
            lambda: ops.paged_attention(
                out, q, k, v, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125, 0, 1.0, 1.0
            ),
            inner=3,
        )
        flops = 4 * seqs * q.shape[1] * q.shape[2] * length * (length + 1) // 2
        print(f"| {seqs} x {length} tokens | {seconds * 1000:.2f} | {flops / seconds / 1e9:.0f} |")
    print()
    # The 250M model's four layer shapes (qkv, o, gate_up, down), four of each: 88 MB of weights,
    # more than the caches hold, so each layer's weights come from memory as in the model.
    shapes = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)] * 4
    plain = [Linear(i, o, bias=False).bfloat16() for o, i in shapes]
    packed = [Linear(i, o, bias=False).bfloat16() for o, i in shapes]
    for layer in packed:
        layer.process_weights_after_loading()
    peak = measure_bf16_dot_peak_gflops(torch.get_num_threads())
    print(
        f"bf16 dot-product peak, {torch.get_num_threads()} threads: "
        + (f"{peak:.0f} GFLOP/s" if peak else "not measured (no C compiler or no AVX-512 BF16)")
    )
    print(
        f"| input rows | Linear GFLOP/s (our kernel, {ROWS_KERNEL_MAX} rows a call) | oneDNN, packed GFLOP/s | "
        "F.linear GFLOP/s | Linear: weight GB/s | Linear: % of the dot peak |"
    )
    print("|---|---|---|---|---|---|")
    params = sum(o * i for o, i in shapes)
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):
        xs = {i: torch.randn(rows, i).bfloat16() for i in {i for _, i in shapes}}
        ways = [
            lambda: [layer(xs[layer.in_features]) for layer in packed],
            lambda: [
                torch.ops.mkldnn._linear_pointwise(xs[layer.in_features], layer.weight, None, "none", [], "")
                for layer in packed
            ],
            lambda: [F.linear(xs[layer.in_features], layer.weight) for layer in plain],
        ]
        with torch.inference_mode():
            seconds = median_seconds_interleaved(ways)
        rates = " | ".join(f"{2 * rows * params / s / 1e9:.0f}" for s in seconds)
        share = f"{100 * 2 * rows * params / seconds[0] / 1e9 / peak:.0f}%" if peak else "n/a"
        print(f"| {rows} | {rates} | {2 * params / seconds[0] / 1e9:.1f} | {share} |")


def median_seconds_interleaved(ways: list, rounds: int = 7) -> list[float]:
    """Each way once per round, in turn, so that the machine's drift falls on all of them alike."""
    times: list[list[float]] = [[] for _ in ways]
    for _ in range(rounds):
        for way, spent in zip(ways, times):
            start = time.perf_counter()
            way()
            spent.append(time.perf_counter() - start)
    return [sorted(spent)[rounds // 2] for spent in times]


if __name__ == "__main__":
    main()
