"""`pagedllm bench throughput`: offline throughput, every request submitted at once, greedy, EOS ignored.

    pagedllm bench throughput --model /tmp/llama-250m --num-prompts 64 --input-len 128 --output-len 128

Datasets: random (--num-prompts x --input-len in x --output-len out), variable (200 requests,
heavy-tailed lengths: input 4..1024, output 4..512), shared (64 requests sharing a 512-token
prefix, 32 own tokens, 128 out). benchmarks/throughput.py adds transformers' speed on the same
requests and the share of the machine's compute roofline.
"""

from __future__ import annotations

import argparse
import json
import time

from pagedllm.benchmarks.datasets import WORKLOADS, Requests, fixed_workload
from pagedllm.config import positive


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", choices=("random", "variable", "shared"), default="random")
    parser.add_argument("--num-prompts", type=positive(int), default=64, help="random dataset")
    parser.add_argument("--input-len", type=positive(int), default=128, help="random dataset")
    parser.add_argument("--output-len", type=positive(int), default=128, help="random dataset")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--output-json", default=None, help="write the results here")


def requests_for(ns: argparse.Namespace, vocab: int) -> Requests:
    if ns.dataset_name == "random":
        return fixed_workload(vocab, ns.seed, ns.num_prompts, ns.input_len, ns.output_len)
    return WORKLOADS[ns.dataset_name](vocab, ns.seed)


def measure(llm, requests: Requests, progress: bool = False) -> float:
    """Seconds to run every request to its full output length, all submitted at once."""
    from pagedllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    if [len(o.outputs[0].token_ids) for o in outputs] != [n for _, n in requests]:
        raise RuntimeError("a request ended before its output length")
    return elapsed


def main(ns: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm import LLM

    llm = LLM(**engine_kwargs)
    vocab = min(llm.engine.model_config.vocab_size, len(llm.get_tokenizer()))
    requests = requests_for(ns, vocab)
    measure(llm, [([5] * 8, 4)] * 2)  # warm-up
    seconds = measure(llm, requests, progress=not ns.disable_tqdm)
    output_tokens = sum(n for _, n in requests)
    total_tokens = output_tokens + sum(len(p) for p, _ in requests)
    result = {
        "dataset": ns.dataset_name,
        "requests": len(requests),
        "elapsed_s": seconds,
        "requests_per_second": len(requests) / seconds,
        "output_tokens_per_second": output_tokens / seconds,
        "tokens_per_second": total_tokens / seconds,
        "total_num_tokens": total_tokens,
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.1f} total "
        f"tokens/s, {result['output_tokens_per_second']:.1f} output tokens/s"
    )
    print("| dataset | requests | seconds | req/s | output tok/s | total tok/s |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {ns.dataset_name} | {len(requests)} | {seconds:.2f} | {result['requests_per_second']:.2f} | "
        f"{result['output_tokens_per_second']:.1f} | {result['tokens_per_second']:.1f} |"
    )
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
