"""`pagedllm bench latency`: the time one batch takes from submission to its last token, offline.

    pagedllm bench latency --model /tmp/llama-250m --input-len 32 --output-len 128 --batch-size 8

Each iteration generates --output-len tokens (greedy, EOS ignored) for --batch-size random
prompts of --input-len tokens; after --num-iters-warmup untimed ones, --num-iters are timed and
their mean and percentiles printed (vLLM's `bench latency`). benchmarks/latency.py measures batch-1
decode against the machine's bandwidth roofline and the time to first token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tqdm import tqdm

from pagedllm.benchmarks.datasets import fixed_workload
from pagedllm.config import positive

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=positive(int), default=32)
    parser.add_argument("--output-len", type=positive(int), default=128)
    parser.add_argument("--batch-size", type=positive(int), default=8)
    parser.add_argument("--n", type=positive(int), default=1, help="samples a prompt")
    parser.add_argument("--num-iters-warmup", type=int, default=3)
    parser.add_argument("--num-iters", type=positive(int), default=10)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--output-json", default=None, help="write the results here")


def main(ns: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.serve import percentile

    llm = LLM(**engine_kwargs)
    vocab = min(llm.engine.model_config.vocab_size, len(llm.get_tokenizer()))
    prompts = [{"prompt_token_ids": p} for p, _ in fixed_workload(vocab, ns.seed, ns.batch_size, ns.input_len)]
    params = SamplingParams(n=ns.n, temperature=1.0 if ns.n > 1 else 0.0, max_tokens=ns.output_len, ignore_eos=True)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in tqdm(range(ns.num_iters_warmup), desc="warm-up", disable=ns.disable_tqdm):
        once()
    latencies = sorted(once() for _ in tqdm(range(ns.num_iters), desc="iterations", disable=ns.disable_tqdm))
    result = {
        "avg_latency": statistics.fmean(latencies),
        "latencies": latencies,
        "percentiles": {str(p): percentile(latencies, p) for p in PERCENTILES},
        "output_tokens_per_second": ns.batch_size * ns.n * ns.output_len / statistics.fmean(latencies),
    }
    print(
        f"Avg latency: {result['avg_latency']:.4f} seconds ({result['output_tokens_per_second']:.1f} output tokens/s)"
    )
    for p, seconds in result["percentiles"].items():
        print(f"{p}% percentile latency: {seconds:.4f} seconds")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
