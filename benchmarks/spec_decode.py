"""Speculative decoding (n-gram) on an input-grounded workload at batch 1: output tokens/s with and
without speculation, alternated in one process, and the acceptance rate.

    .venv/bin/python benchmarks/spec_decode.py --rounds 3          # the default model, ~2 minutes

The workload (benchmarks/data/grounded_tasks.json): requests that edit or quote a given text or
code (rename a function, fix typos, add docstrings, make a table, quote a sentence), through the
chat template, greedy, up to --max-tokens each, one request at a time. Both engines get the same
requests; the script reports how many greedy outputs are equal with and without speculation, and
where the others first differ (a verification step computes several positions at once, through
other kernel paths than a decode step's: on bf16 and quantized weights their rounding can tip a
near-tie).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TASKS = os.path.join(os.path.dirname(__file__), "data", "grounded_tasks.json")


def run(llm, conversations: list, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Output tokens/s over the requests one at a time, and their tokens."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tokens, outputs, start = 0, [], time.perf_counter()
    for conversation in conversations:
        output = llm.chat([conversation], params, use_tqdm=False)[0].outputs[0]
        tokens += len(output.token_ids)
        outputs.append(output.token_ids)
    return tokens / (time.perf_counter() - start), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="none: a GGUF file dequantized at load to --dtype")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    args = parser.parse_args()

    from pagedllm import LLM

    with open(TASKS) as f:
        conversations = [[{"role": "user", "content": f"{t['task']}\n\n{t['text']}"}] for t in json.load(f)]
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
                   "prompt_lookup_min": args.lookup_min}
    common = dict(enable_prefix_caching=False, dtype=args.dtype, quantization=args.quantization)
    engines = {"plain": LLM(args.model, **common), "ngram": LLM(args.model, speculative_config=spec_config, **common)}
    for llm in engines.values():  # warm-up
        run(llm, conversations[:1], 8)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        outputs = {}
        for name, llm in engines.items():
            rate, outputs[name] = run(llm, conversations, args.max_tokens)
            rates[name].append(rate)
        first_diffs = [next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), None if len(a) == len(b) else
                            min(len(a), len(b))) for a, b in zip(outputs["plain"], outputs["ngram"])]
        print(f"round {round_}: plain {rates['plain'][-1]:.1f} tok/s, ngram {rates['ngram'][-1]:.1f} tok/s, "
              f"ratio {rates['ngram'][-1] / rates['plain'][-1]:.2f}; outputs equal "
              f"{first_diffs.count(None)}/{len(first_diffs)}, the others first differ at tokens "
              f"{[d for d in first_diffs if d is not None]}")
    stats = engines["ngram"].engine.stats()
    ratios = [b / a for a, b in zip(rates["plain"], rates["ngram"])]
    print(f"median: plain {statistics.median(rates['plain']):.1f} tok/s, ngram {statistics.median(rates['ngram']):.1f} "
          f"tok/s, ratio {statistics.median(ratios):.2f}")
    print(f"drafts {stats.spec_num_drafts}, draft tokens {stats.spec_num_draft_tokens}, accepted "
          f"{stats.spec_num_accepted_tokens} ({stats.spec_num_accepted_tokens / max(stats.spec_num_draft_tokens, 1):.0%}), "
          f"{stats.spec_num_accepted_tokens / max(stats.spec_num_drafts, 1):.2f} accepted a draft")


if __name__ == "__main__":
    main()
