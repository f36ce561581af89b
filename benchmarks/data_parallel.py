"""Data parallelism on one machine: DP=N (N engine replicas, a process each on its share of the
cores) against one engine (a thread per core), alternated in one process.

    .venv/bin/python benchmarks/make_model.py --out /tmp/llama-250m
    .venv/bin/python benchmarks/data_parallel.py --model /tmp/llama-250m --rounds 3

Workloads: --batch prompts of 128 random tokens, 64 greedy tokens each, submitted together; and
the same number of prompts in 4 groups that share a 256-token prefix (a system prompt each), where
each group's prefix is computed once per replica that serves it. Output tokens/s, medians of the
rounds, and the replicas' share of prompt tokens found in their prefix caches.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics

from tensor_parallel import run

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()

    from pagedllm import LLM

    common = dict(dtype=args.dtype, max_model_len=512, kv_cache_memory="1GiB")
    engines = {1: LLM(args.model, **common), args.dp: LLM(args.model, data_parallel_size=args.dp, **common)}
    vocab = engines[1].engine.model_config.vocab_size
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefixes = [tokens(256) for _ in range(4)]
    workloads = {
        f"{args.batch} prompts at once": lambda: [tokens(128) for _ in range(args.batch)],
        f"{args.batch} prompts, 4 shared prefixes": lambda: [prefixes[i % 4] + tokens(32) for i in range(args.batch)],
    }
    for name, make in workloads.items():
        for llm in engines.values():
            run(llm, [tokens(8)], 4)  # warm-up
        rates: dict[int, list[float]] = {size: [] for size in engines}
        for round_ in range(args.rounds):
            prompts = make()  # fresh suffixes a round: only the shared prefixes are cached
            for size in list(engines) if round_ % 2 == 0 else list(reversed(engines)):
                rates[size].append(run(engines[size], prompts, 64))
        one, many = statistics.median(rates[1]), statistics.median(rates[args.dp])
        print(f"{name}: one engine {one:.1f} tok/s, DP={args.dp} {many:.1f} tok/s, ratio {many / one:.2f}")
    for size, llm in engines.items():
        hits = [f"{s.prefix_cache_hits / max(s.prefix_cache_queries, 1):.0%}" for s in llm.engine.replica_stats()]
        print(f"prefix-cache hits, {'one engine' if size == 1 else f'DP={size} by replica'}: {', '.join(hits)}")
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
