"""Linear layers of 16-column blocks: our batch-invariant kernel (BlockedLinearMethod,
blocked_linear_rows) against F.linear on the same weights, in the same process: fp32 (against
MKL's GEMM), or bf16 (against F.linear's bf16 path, which on a CPU without AVX-512 is all that
serves bf16 weights besides ours).

    .venv/bin/python benchmarks/blocked_linear.py
    .venv/bin/python benchmarks/blocked_linear.py --dtype bfloat16 --rows 1 64 512 --rounds 9

The 250M model's four layer shapes (qkv, o, gate_up, down), four of each (176 MB of fp32 weights,
more than the caches hold, so each layer's weights come from memory as in the model), in turn;
per row count, the two ways alternate for --rounds rounds and each way's median round is shown as
GFLOP/s, with ours over F.linear's (the median of the rounds' ratios, and their range).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_ops
from pagedllm.layers.linear import BlockedLinearMethod, Linear

SHAPES_250M = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]  # (out, in): qkv, o, gate_up, down


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    if cpu_ops() is None:
        raise SystemExit("the C++ kernels are not available here")
    shapes = SHAPES_250M * 4
    plain = [Linear(i, o, bias=False).to(dtype) for o, i in shapes]
    ours = [Linear(i, o, bias=False).to(dtype) for o, i in shapes]
    for a, b in zip(plain, ours):
        b.weight.data.copy_(a.weight.data)
        b.method = BlockedLinearMethod()  # (bf16: even where oneDNN would pack it)
        b.process_weights_after_loading()
    params = sum(o * i for o, i in shapes)
    threads = torch.get_num_threads()
    print(f"{args.dtype} linear, 16 layers of the 250M model's shapes, {threads} threads, {args.rounds} rounds")
    print("| input rows | ours GFLOP/s | F.linear GFLOP/s | ours / F.linear (range) |")
    print("|---|---|---|---|")
    for rows in args.rows:
        xs = {i: torch.randn(rows, i).to(dtype) for i in {i for _, i in shapes}}
        ways = [
            lambda: [layer(xs[layer.in_features]) for layer in ours],
            lambda: [F.linear(xs[layer.in_features], layer.weight) for layer in plain],
        ]
        times: list[list[float]] = [[], []]
        with torch.inference_mode():
            for way in ways:
                way()  # warm
            for r in range(args.rounds):
                for k in range(2) if r % 2 == 0 else (1, 0):
                    start = time.perf_counter()
                    ways[k]()
                    times[k].append(time.perf_counter() - start)
        ratios = [f / o for o, f in zip(*times)]
        rates = [2 * rows * params / statistics.median(t) / 1e9 for t in times]
        print(
            f"| {rows} | {rates[0]:.1f} | {rates[1]:.1f} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )


if __name__ == "__main__":
    main()
