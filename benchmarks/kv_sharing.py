"""KV memory saved by sharing blocks: prefix caching, parallel sampling (n), beam search.

    python benchmarks/kv_sharing.py

Runs the default model (or --model) through the engine and records the peak number of KV blocks
in use (held by at least one request) at any step, for each workload with and without sharing:
(a) 32 requests sharing a 1,000-token system prompt, prefix caching on vs off (the prompt was
    seen once before, as on a server that has served it), with the mean time to first token;
(b) one request with n=4 parallel samples vs 4 separate requests of the same prompt;
(c) beam search of width 4 vs 4 independent requests of the same prompt.
(b) and (c) run with prefix caching off, so that only forking shares blocks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PAGEDLLM_NO_PROGRESS", "1")

from common import PeakTracker  # noqa: E402
from pagedllm import BeamSearchParams, SamplingParams  # noqa: E402
from pagedllm.config import EngineArgs  # noqa: E402
from pagedllm.engine.beam_search import BeamSearch  # noqa: E402
from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402


def run_requests(engine: LLMEngine, tracker: PeakTracker, prompts: list[list[int]], params: SamplingParams) -> float:
    """Submit all at once, run to the end; returns the mean time to first token in seconds."""
    tracker.reset()
    start = time.perf_counter()
    ids = [engine.add_request(None, p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return sum(tracker.first_token[i] - start for i in ids) / len(ids)


def tokens(engine: LLMEngine, count: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000, engine.model_config.vocab_size - 1000) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    def engine(caching: bool) -> tuple[LLMEngine, PeakTracker]:
        e = LLMEngine(
            EngineArgs(
                args.model,
                block_size=args.block_size,
                enable_prefix_caching=caching,
                kv_cache_memory="2GiB",
                max_model_len=4096,
            )
        )
        return e, PeakTracker(e)

    pairs = []  # (workload, without sharing, with sharing): each {"label", "peak", "ttft"?}

    # (a) a shared system prompt, already seen once
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    results = []
    for caching in (False, True):
        e, tracker = engine(caching)
        system = tokens(e, 1000, seed=1)
        run_requests(e, tracker, [system + tokens(e, 24, seed=99)], greedy)
        ttft = run_requests(e, tracker, [system + tokens(e, 24, seed=100 + i) for i in range(32)], greedy)
        results.append({"label": f"prefix caching {'on' if caching else 'off'}", "peak": tracker.peak, "ttft": ttft})
        del e, tracker
    pairs.append(("32 x (1000 shared + 24) in, 32 out", *results))

    # (b) and (c): only forking shares blocks
    e, tracker = engine(False)
    prompt = tokens(e, 512, seed=2)
    sample = SamplingParams(temperature=0.8, seed=0, max_tokens=128, ignore_eos=True)
    run_requests(e, tracker, [prompt] * 4, sample)
    separate = {"label": "4 separate requests", "peak": tracker.peak}
    run_requests(e, tracker, [prompt], dataclasses.replace(sample, n=4))
    pairs.append(("512 in, 128 out, 4 samples", separate, {"label": "n=4 (forked)", "peak": tracker.peak}))
    run_requests(e, tracker, [prompt] * 4, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    independent = {"label": "4 independent requests", "peak": tracker.peak}
    tracker.reset()
    BeamSearch(e, BeamSearchParams(beam_width=4, max_tokens=128, ignore_eos=True)).run([prompt])
    pairs.append(("512 in, 128 out, width 4", independent, {"label": "beam search (forked)", "peak": tracker.peak}))

    print(f"block size {args.block_size} tokens\n")
    print("| workload | without sharing: peak blocks | with sharing: peak blocks | saved | mean TTFT without / with |")
    print("|---|---|---|---|---|")
    for workload, without, shared in pairs:
        ttft = f"{without['ttft']:.2f} s / {shared['ttft']:.2f} s" if "ttft" in shared else ""
        print(
            f"| {workload} | {without['label']}: {without['peak']} | {shared['label']}: {shared['peak']} | "
            f"{1 - shared['peak'] / without['peak']:.0%} | {ttft} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(pairs, f, indent=2)


if __name__ == "__main__":
    main()
