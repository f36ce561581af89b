"""Tensor parallelism on one machine: TP=N (a worker process per rank on its own cores) against
TP=1 (one process, a thread per core), engines alternated in one process, and the share of the
TP engine's time its rank 0 spends in collectives (waiting for the other ranks included).

    .venv/bin/python benchmarks/make_model.py --out /tmp/llama-250m
    .venv/bin/python benchmarks/tensor_parallel.py --model /tmp/llama-250m --rounds 3
    .venv/bin/python benchmarks/tensor_parallel.py --quantization none --dtype float32   # the default model
    .venv/bin/python benchmarks/tensor_parallel.py --model /tmp/llama-250m --backend ray  # ranks as Ray actors

Workloads: batch-1 decode (one prompt of 32 random tokens, --decode-tokens greedy tokens) and a
fixed batch (--batch prompts of 128 random tokens, 64 greedy tokens each, submitted together).
Output tokens/s, medians of the rounds; then what one batch-1 decode step sends: its collectives and
the bytes each rank puts in (docs/SCALING.md builds on these).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--backend", default="mp", choices=["mp", "ray"], help="how the ranks run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()

    from pagedllm import LLM

    common = dict(
        dtype=args.dtype,
        quantization=args.quantization,
        enable_prefix_caching=False,
        max_model_len=512,
        kv_cache_memory="1GiB",
    )
    engines = {
        1: LLM(args.model, **common),
        args.tp: LLM(args.model, tensor_parallel_size=args.tp, distributed_executor_backend=args.backend, **common),
    }
    executor = engines[args.tp].engine.core.executor
    vocab = engines[1].engine.model_config.vocab_size
    rng = random.Random(0)
    workloads = {
        "batch-1 decode": ([[rng.randrange(3, vocab) for _ in range(32)]], args.decode_tokens),
        f"{args.batch} prompts at once": (
            [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(args.batch)],
            64,
        ),
    }
    for name, (prompts, max_tokens) in workloads.items():
        for llm in engines.values():
            run(llm, prompts[:1], 4)  # warm-up
        rates: dict[int, list[float]] = {size: [] for size in engines}
        shares = []
        for round_ in range(args.rounds):
            for size in list(engines) if round_ % 2 == 0 else list(reversed(engines)):
                executor.collective_time()  # reset
                start = time.perf_counter()
                rates[size].append(run(engines[size], prompts, max_tokens))
                if size == args.tp:
                    seconds, calls, _ = executor.collective_time()
                    shares.append((seconds / (time.perf_counter() - start), calls))
        one, many = statistics.median(rates[1]), statistics.median(rates[args.tp])
        share, calls = shares[len(shares) // 2]
        print(
            f"{name}: TP=1 {one:.1f} tok/s, TP={args.tp} {many:.1f} tok/s, ratio {many / one:.2f}; "
            f"rank 0 in collectives {share:.0%} of the time ({calls} collectives a run)"
        )
    calls, nbytes = decode_communication(engines[args.tp], executor, workloads["batch-1 decode"][0])
    print(
        f"communication of one batch-1 decode step: {calls:.0f} collectives, {nbytes / 1024:.1f} KiB put in by "
        f"each rank ({engines[1].engine.model_config.hf_config.num_hidden_layers} layers)"
    )
    for llm in engines.values():
        llm.engine.shutdown()


def decode_communication(llm, executor, prompts: list[list[int]], steps: int = 16) -> tuple[float, float]:
    """Collectives and bytes a rank puts in per decode step: a run of 1 + steps tokens less a run of
    1 (the prompt's step), divided by steps."""
    totals = []
    for max_tokens in (1, 1 + steps):
        executor.collective_time()  # reset
        run(llm, prompts, max_tokens)
        totals.append(executor.collective_time())
    return (totals[1][1] - totals[0][1]) / steps, (totals[1][2] - totals[0][2]) / steps


if __name__ == "__main__":
    main()
