"""Prefill time with the C++ decoder stack's pieces (models/decoder.py's PIECE_ROWS) against one pass
over a whole step, on a GGUF file: two engines in one process, rounds alternated.

    .venv/bin/python benchmarks/stack_pieces.py /tmp/gpt-oss-moe-MXFP4.gguf

Each round times 64 prompts of 128 tokens (steps of 2048 tokens from 16 sequences) and one prompt of
2048 tokens (a step of one sequence), one output token each; the table gives the medians' ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm import LLM, SamplingParams
from pagedllm.models import decoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engines = {}
    for name, rows in (("pieces", decoder.PIECE_ROWS), ("whole", 1 << 30)):
        decoder.PIECE_ROWS = rows  # read as the stack is built
        engines[name] = LLM(
            args.gguf, quantization="gguf", max_model_len=4096, enable_prefix_caching=False, kv_cache_memory="1GiB"
        )
    vocab = engines["pieces"].engine.model_config.vocab_size
    rng = random.Random(0)
    workloads = {
        "64 x 128": [[rng.randrange(100, vocab - 100) for _ in range(128)] for _ in range(64)],
        "1 x 2048": [[rng.randrange(100, vocab - 100) for _ in range(2048)]],
    }
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    seconds: dict[tuple[str, str], list[float]] = {(e, w): [] for e in engines for w in workloads}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            for workload, prompts in workloads.items():
                start = time.perf_counter()
                llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                seconds[(name, workload)].append(time.perf_counter() - start)
    print("| prompts | pieces s (rounds) | whole s (rounds) | pieces / whole |")
    print("|---|---|---|---|")
    for workload in workloads:
        a, b = seconds[("pieces", workload)], seconds[("whole", workload)]
        ratio = statistics.median(a) / statistics.median(b)
        print(
            f"| {workload} | {statistics.median(a):.2f} ({min(a):.2f}-{max(a):.2f}) | "
            f"{statistics.median(b):.2f} ({min(b):.2f}-{max(b):.2f}) | {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
