"""The quantized linear kernels alone, against the bf16 kernel in the same process.

    .venv/bin/python benchmarks/quant_kernels.py                  # every type, a 5632 x 1024 layer
    .venv/bin/python benchmarks/quant_kernels.py --types Q4_K Q8_0 --rows 1 4 64 512
    .venv/bin/python benchmarks/quant_kernels.py --types Q4_1 Q8_0 --rows --stream --stream-rows 1 4 5 8

Per type and row count: GFLOP/s of the int8 path (activations quantized per 32, VNNI dot
products; the one path at every row count) and of the bf16 linear layer (PackedBF16LinearMethod)
on the same shape; the weights
stay in cache between calls, so this is arithmetic, not bandwidth. Then, with --stream, batch-1
decode's case (with --stream-rows, also a speculative verification's few rows a call; --rows
with no values skips the first table): a 16-layer stack of the 250M model's four layer shapes,
every call reading its weights from memory (104 MB at Q4_K, 490 MB at bf16), as GB/s against the bf16 layers'. Rounds
alternate the contenders; the table shows medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedllm.kernels import cpu_ops  # noqa: E402
from pagedllm.layers.linear import Linear  # noqa: E402
from pagedllm.layers.quantization.formats import FORMATS, decode, pack  # noqa: E402

SHAPES_250M = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]  # qkv, o, gate_up, down


def random_packed(name: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random valid blocks of a type (small positive scales), packed."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // fmt.block_values, fmt.block_bytes), dtype=np.uint8)
    halves = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(name, (0,))
    for offset in halves:
        blocks[..., offset : offset + 2] = (
            rng.uniform(1e-3, 1e-2, blocks.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
        )
    return pack(decode(blocks.reshape(rows, -1), fmt))


def quant_layer(name: str, rows: int, cols: int, seed: int = 0):
    return cpu_ops().QuantLinear([(random_packed(name, rows, cols, seed), FORMATS[name].format_id, rows)], cols, None)


def bf16_layer(rows: int, cols: int) -> Linear:
    layer = Linear(cols, rows, bias=False).bfloat16()
    layer.process_weights_after_loading()
    return layer


def seconds(fn, x: torch.Tensor, reps: int) -> float:
    fn(x)
    start = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - start) / reps


def arithmetic(types: list[str], rows_list: list[int], rounds: int, n: int, k: int) -> None:
    print(f"Arithmetic, a {n} x {k} layer in cache, GFLOP/s (medians of {rounds} alternated rounds)\n")
    print("| type | rows | int8 path | bf16 layer | quantized / bf16 |")
    print("|---|---|---|---|---|")
    dense = bf16_layer(n, k)
    for name in types:
        int8 = quant_layer(name, n, k)
        for rows in rows_list:
            x = torch.randn(rows, k).bfloat16()
            reps = max(3, 400 // rows)
            times = {"int8": [], "bf16": []}
            for _ in range(rounds):
                for key, fn in (("int8", int8), ("bf16", dense)):
                    times[key].append(seconds(fn, x, reps))
            gflops = {key: 2 * n * k * rows / statistics.median(v) / 1e9 for key, v in times.items()}
            print(
                f"| {name} | {rows} | {gflops['int8']:.0f} | {gflops['bf16']:.0f} | "
                f"{gflops['int8'] / gflops['bf16']:.2f} |"
            )


def stream(types: list[str], rounds: int, rows: int = 1, layers: int = 16) -> None:
    print(
        f"\n{rows} row(s) a call, weights from memory: {layers} layers of each of the 250M model's shapes in turn, "
        f"GB/s (medians of {rounds} alternated rounds)\n"
    )
    stacks = {"bf16": [(bf16_layer(n, k), k, 2 * n * k) for _ in range(layers) for n, k in SHAPES_250M]}
    for name in types:
        stacks[name] = [
            (quant_layer(name, n, k, seed=i), k, FORMATS[name].packed_bytes(n, k))
            for i in range(layers)
            for n, k in SHAPES_250M
        ]
    xs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES_250M}

    def run(stack) -> float:
        start = time.perf_counter()
        for layer, k, _ in stack:
            layer(xs[k])
        return time.perf_counter() - start

    rates: dict[str, list[float]] = {key: [] for key in stacks}
    for _ in range(rounds):
        for key, stack in stacks.items():
            run(stack)
            rates[key].append(sum(b for _, _, b in stack) / run(stack) / 1e9)
    print("| weights | MB | GB/s | / bf16's | ms a pass |")
    print("|---|---|---|---|---|")
    for key, stack in stacks.items():
        total = sum(b for _, _, b in stack)
        rate = statistics.median(rates[key])
        print(
            f"| {key} | {total / 1e6:.0f} | {rate:.1f} | {rate / statistics.median(rates['bf16']):.2f} | "
            f"{total / rate / 1e6:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=sorted(FORMATS))
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16, 32, 64, 128, 512])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shape", type=int, nargs=2, default=(5632, 1024), metavar=("N", "K"))
    parser.add_argument("--stream", action="store_true", help="also batch 1 with weights from memory")
    parser.add_argument(
        "--stream-rows",
        type=int,
        nargs="+",
        default=[1],
        help="--stream: rows a call (a speculative verification's are k + 1)",
    )
    args = parser.parse_args()
    if cpu_ops() is None or not cpu_ops().quant_linear_simd():
        raise SystemExit("needs the C++ kernels with a vector path (AVX512-VNNI or AVX2)")
    if args.rows:
        arithmetic(args.types, args.rows, args.rounds, *args.shape)
    for rows in args.stream_rows if args.stream else []:
        stream(args.types, args.rounds, rows)


if __name__ == "__main__":
    main()
