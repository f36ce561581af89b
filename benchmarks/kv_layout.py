"""Where K/V blocks lie: each request's blocks in runs (the block pool's placement) against every
block from the front of a plain free queue (the placement before), in one process.

    python benchmarks/kv_layout.py
    python benchmarks/kv_layout.py --model /tmp/llama-250m   # and the variable workload end to end

Kernel: the variable workload's 200 requests are placed as the engine grows them (every prompt,
then a token per request in turn until each has its output; none freed), once through
KVCacheManager and once from a FIFO free list. Then all 200 decode at their final context, over
several layers' caches in turn (so K/V comes from memory), the two placements alternating round
after round: K/V GB/s (median round) and the share of blocks that follow their predecessor.
End to end (--model): the variable workload, prefix caching off, the placement switched between
runs; output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import deque

import torch

import common

BLOCK = 16


def place(lengths: list[tuple[int, int]], num_blocks: int, runs: bool) -> list[list[int]]:
    """Block tables of requests (prompt, output) grown as the engine grows them."""
    from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
    from pagedllm.core.request import Request
    from pagedllm.sampling_params import SamplingParams

    if not runs:
        free = deque(range(num_blocks))
        tables = [[free.popleft() for _ in range(cdiv(p, BLOCK))] for p, _ in lengths]
        for step in range(max(o for _, o in lengths)):
            for (p, o), table in zip(lengths, tables):
                if step < o and cdiv(p + step + 1, BLOCK) > len(table):
                    table.append(free.popleft())
        return tables
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=False)
    requests = [
        Request(f"r{i}", [1] * p, SamplingParams(max_tokens=o), o, frozenset()) for i, (p, o) in enumerate(lengths)
    ]
    for request in requests:
        assert kv.allocate_slots(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
    for step in range(max(o for _, o in lengths)):
        for (_, o), request in zip(lengths, requests):
            if step < o:
                assert kv.allocate_slots(request, 1)
                request.num_computed_tokens += 1
    return [kv.block_ids(r.request_id) for r in requests]


def run_share(tables: list[list[int]]) -> float:
    pairs = [(a, b) for t in tables for a, b in zip(t, t[1:])]
    return sum(b == a + 1 for a, b in pairs) / len(pairs)


def kernel(layers: int, rounds: int) -> dict:
    from pagedllm.kernels import cpu_ops

    ops = cpu_ops()
    lengths = [(len(p), o) for p, o in common.variable_workload(32000)]
    num_blocks = 2 * sum(-(-(p + o) // BLOCK) for p, o in lengths)
    heads, kv_heads, d = 16, 4, 64
    caches = [
        (torch.randn(num_blocks, BLOCK, kv_heads, d).bfloat16(), torch.randn(num_blocks, BLOCK, kv_heads, d).bfloat16())
        for _ in range(layers)
    ]
    seq_lens = torch.tensor([p + o for p, o in lengths], dtype=torch.int32)
    q = torch.randn(len(lengths), heads, d).bfloat16()
    out = torch.empty_like(q)
    starts = torch.arange(len(lengths) + 1, dtype=torch.int32)
    kv_bytes = int(seq_lens.sum()) * 2 * kv_heads * d * 2 * layers
    result = {}
    for name, runs in (("runs", True), ("front of the queue", False)):
        tables = place(lengths, num_blocks, runs)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        result[name] = {"table": table, "run_share": run_share(tables), "rates": []}
    for _ in range(rounds):
        for entry in result.values():
            start = time.perf_counter()
            for k, v in caches:
                ops.paged_attention(out, q, k, v, entry["table"], starts, seq_lens, d**-0.5, 0, 1.0, 1.0)
            entry["rates"].append(kv_bytes / (time.perf_counter() - start) / 1e9)
    return {
        name: {"run_share": e["run_share"], "kv_gbs": statistics.median(e["rates"]), "rounds": e["rates"]}
        for name, e in result.items()
    }


def end_to_end(model: str, rounds: int) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.core import block_pool

    llm = LLM(model, enable_prefix_caching=False)
    requests = common.variable_workload(llm.engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    placed, set_aside = block_pool.BlockPool.get_new_blocks, block_pool.SET_ASIDE
    front = lambda pool, n, after=None: placed(pool, n)  # noqa: E731 - the request's last block ignored
    rates: dict[str, list[float]] = {"runs": [], "front of the queue": []}
    for _ in range(rounds):
        for name in rates:
            block_pool.BlockPool.get_new_blocks = placed if name == "runs" else front
            block_pool.SET_ASIDE = set_aside if name == "runs" else 0
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            rates[name].append(sum(n for _, n in requests) / (time.perf_counter() - start))
    block_pool.BlockPool.get_new_blocks, block_pool.SET_ASIDE = placed, set_aside
    return {name: {"output_tok_s": statistics.median(r), "rounds": r} for name, r in rates.items()}


def print_comparison(results: dict, key: str, header: str) -> None:
    print(f"| placement | {header} (median) | rounds |")
    print("|---|---|---|")
    for name, e in results.items():
        print(f"| {name} | {e[key]:.1f} | {' '.join(f'{x:.1f}' for x in e['rounds'])} |")
    print(f"\nruns / front: {results['runs'][key] / results['front of the queue'][key]:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="layers' caches read in turn")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", default=None, help="also run the variable workload end to end on this model")
    parser.add_argument("--e2e-rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {"kernel": kernel(args.layers, args.rounds)}
    print(
        "blocks after their predecessor: "
        + ", ".join(f"{name} {e['run_share']:.1%}" for name, e in report["kernel"].items())
        + "\n"
    )
    print_comparison(report["kernel"], "kv_gbs", "decode attention K/V GB/s")
    if args.model:
        report["end_to_end"] = end_to_end(args.model, args.e2e_rounds)
        print()
        print_comparison(report["end_to_end"], "output_tok_s", "variable workload, output tok/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
