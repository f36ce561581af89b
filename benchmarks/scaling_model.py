"""How far tensor, pipeline and data parallelism go, on paper: a decode step's time on N CPU nodes
from the weights each node reads and the messages the ranks exchange, for the links a cluster may
have. The figures go in docs/SCALING.md.

    .venv/bin/python benchmarks/scaling_model.py                 # Llama 3 70B at Q4_K_M on 4 nodes
    .venv/bin/python benchmarks/scaling_model.py --nodes 2 --batch 16

What a step sends is pagedllm's, as measured by benchmarks/tensor_parallel.py (its "communication
of one batch-1 decode step" line): per layer two all-reduces of the hidden state, whose shares are
fp32 until summed (4 bytes a value), one all-reduce after the embedding (the model's dtype) and an
all-gather of each rank's logits (the model's dtype): 2L + 2 collectives a step. Measured on this
machine: SmolLM2-135M fp32 at TP=2, 62 collectives and 233.2 KiB a rank a step; the 250M bf16
model, 34 and 161.2 KiB; this script's formula gives the same.

The rest are stated assumptions, each a flag: a decode step reads every weight once, from memory
at --node-bandwidth GB/s (batch-1 decode is bandwidth-bound on a CPU); a collective among n ranks
runs as the faster of a ring (2(n-1) messages of S/n bytes in turn for an all-reduce) and recursive
doubling (log2 n messages of S bytes), each message costing the link's latency plus bytes over its
bandwidth; pipeline stages pass the hidden state (bf16) once a stage boundary per step.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

# (name, bandwidth in GB/s one way, latency of one small message in microseconds). Public
# orders of magnitude, not measurements: a socket-to-socket fabric through shared memory, RDMA,
# kernel TCP. The last is gloo's all-reduce over this machine's loopback as measured (docs/benchmarks-history.md).
LINKS = [
    ("shared memory across sockets", 40.0, 1.0),
    ("100 GbE, RDMA", 11.0, 3.0),
    ("25 GbE, TCP", 2.8, 25.0),
    ("10 GbE, TCP", 1.1, 50.0),
    ("gloo on TCP, as measured here", 1.1, 1800.0),
]


@dataclass
class Model:
    name: str
    hidden: int
    layers: int
    vocab: int
    kv_heads: int
    head_dim: int
    weight_gb: float  # the whole model's weights as stored (quantized)
    dtype_bytes: int = 2  # activations and the KV cache (bf16)


LLAMA3_70B_Q4 = Model(
    "Llama 3 70B, Q4_K_M", hidden=8192, layers=80, vocab=128256, kv_heads=8, head_dim=128, weight_gb=42.5
)


# The models benchmarks/tensor_parallel.py measured at TP=2, with what it measured (KiB a rank a step).
MEASURED = [
    (Model("SmolLM2-135M fp32", 576, 30, 49152, 3, 64, 0.54, dtype_bytes=4), 62, 233.2),
    (Model("250M bf16 (make_model.py)", 1024, 16, 32000, 4, 64, 0.5), 34, 161.2),
]


def message_s(nbytes: float, gb_s: float, latency_us: float) -> float:
    return latency_us * 1e-6 + nbytes / (gb_s * 1e9)


def all_reduce_s(nbytes: float, n: int, gb_s: float, latency_us: float) -> float:
    if n == 1:
        return 0.0
    ring = 2 * (n - 1) * message_s(nbytes / n, gb_s, latency_us)
    doubling = math.ceil(math.log2(n)) * message_s(nbytes, gb_s, latency_us)
    return min(ring, doubling)


def all_gather_s(share_bytes: float, n: int, gb_s: float, latency_us: float) -> float:
    if n == 1:
        return 0.0
    ring = (n - 1) * message_s(share_bytes, gb_s, latency_us)
    doubling = sum(message_s(share_bytes * 2**i, gb_s, latency_us) for i in range(math.ceil(math.log2(n))))
    return min(ring, doubling)


def tp_step_bytes(m: Model, n: int, batch: int) -> tuple[int, float]:
    """Collectives a decode step and the bytes one rank puts in (pagedllm's layers)."""
    layer = 2 * m.layers * batch * m.hidden * 4  # fp32 shares of the row-parallel outputs
    embed = batch * m.hidden * m.dtype_bytes
    logits = batch * (m.vocab / n) * m.dtype_bytes
    return 2 * m.layers + 2, layer + embed + logits


def tp_comm_s(m: Model, n: int, batch: int, gb_s: float, latency_us: float) -> float:
    layer = 2 * m.layers * all_reduce_s(batch * m.hidden * 4, n, gb_s, latency_us)
    embed = all_reduce_s(batch * m.hidden * m.dtype_bytes, n, gb_s, latency_us)
    return layer + embed + all_gather_s(batch * m.vocab / n * m.dtype_bytes, n, gb_s, latency_us)


def kv_bytes_per_token(m: Model) -> int:
    return 2 * m.layers * m.kv_heads * m.head_dim * m.dtype_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together in a step")
    parser.add_argument(
        "--node-bandwidth",
        type=float,
        default=200.0,
        help="GB/s a node's cores read weights at (8-channel DDR5-4800: 307 peak, ~200 reached)",
    )
    parser.add_argument("--context", type=int, default=8192, help="tokens of KV cache a sequence holds")
    args = parser.parse_args()
    for model, measured_calls, measured_kib in MEASURED:
        calls, nbytes = tp_step_bytes(model, 2, 1)
        print(
            f"check, {model.name} at TP=2: {calls} collectives, {nbytes / 1024:.1f} KiB a rank a step "
            f"(measured: {measured_calls}, {measured_kib} KiB)"
        )
    m, n, b = LLAMA3_70B_Q4, args.nodes, args.batch
    weights_s = m.weight_gb / args.node_bandwidth  # one node reading all of them
    calls, nbytes = tp_step_bytes(m, n, b)
    kv = kv_bytes_per_token(m)
    print(
        f"{m.name}: {m.weight_gb} GB of weights, {kv / 1024:.0f} KiB of KV a token "
        f"({kv * args.context / 2**30:.2f} GiB for a {args.context}-token sequence); "
        f"{n} nodes at {args.node_bandwidth:.0f} GB/s each; batch {b}"
    )
    print(
        f"per node: TP/PP {m.weight_gb / n:.1f} GB of weights + {kv * args.context * b / n / 2**30:.2f} GiB KV; "
        f"DP {m.weight_gb:.1f} GB + {kv * args.context * b / 2**30:.2f} GiB KV"
    )
    print(f"one node alone: {weights_s * 1e3:.0f} ms a step, {b / weights_s:.1f} tok/s")
    print(f"TP={n} sends {calls} collectives a step, {nbytes / 1024:.0f} KiB put in by each rank\n")
    print(
        f"| link | TP comm ms/step | TP ms/step | TP tok/s (batch {b}) | PP ms/step | PP tok/s ({n} micro-batches "
        f"of {b}) | DP tok/s ({n} replicas of {b}) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, gb_s, latency_us in LINKS:
        comm = tp_comm_s(m, n, b, gb_s, latency_us)
        tp = weights_s / n + comm
        hop = message_s(b * m.hidden * m.dtype_bytes, gb_s, latency_us)
        pp = weights_s + (n - 1) * hop  # stages in turn: a sequence's step crosses every node
        pp_throughput = b / (weights_s / n + hop)  # n micro-batches of b in flight: one leaves each stage time
        print(
            f"| {name} ({gb_s:g} GB/s, {latency_us:g} us) | {comm * 1e3:.1f} | {tp * 1e3:.1f} | {b / tp:.1f} | "
            f"{pp * 1e3:.0f} | {pp_throughput:.1f} | {n * b / weights_s:.1f} |"
        )


if __name__ == "__main__":
    main()
