"""Speculative decoding: output tokens/s with and without speculation, alternated in one process,
and the acceptance rate.

    .venv/bin/python benchmarks/spec_decode.py --rounds 3                              # grounded, batch 1
    .venv/bin/python benchmarks/spec_decode.py --workload random --rounds 3            # random output, batch 1
    .venv/bin/python benchmarks/spec_decode.py --workload random --batch 32 --rounds 3 # 32 at once
    .venv/bin/python benchmarks/spec_decode.py --method draft_model --quantization none \
        --draft-quantization gguf --rounds 3   # the default model's Q4_1 kernels drafting for its bf16 weights

Workloads:
- grounded (benchmarks/data/grounded_tasks.json): requests that edit or quote a given text or code
  (rename a function, fix typos, add docstrings, make a table, quote a sentence), through the chat
  template, greedy, up to --max-tokens each. --tasks benchmarks/data/grounded_long_tasks.json: the
  same kinds of edits on texts about 3x longer (a 45-line module, a 10-sentence paragraph), as
  files people ask to edit are; give them --max-tokens 400 to let the answers run to their end.
  The script reports how many greedy outputs are equal
  with and without speculation, and where the others first differ.
- random: prompts of random token ids, sampled at temperature 1 (seeded), EOS ignored: output that
  seldom repeats itself, where n-gram drafts rarely exist or hold (speculation's cost, not its gain).

--batch N submits N requests at once (continuous batching), else one at a time.

With n-gram lookup on the grounded workload at batch 1, the script also gives the ratio no tuning
could pass: the plain engine's time over the time its prefill and the fewest decode steps would
take (each proposal cut to exactly the drafts that hold, verification rows free).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TASKS = os.path.join(os.path.dirname(__file__), "data", "grounded_tasks.json")


def workload(name: str, vocab: int, num_prompts: int, max_tokens: int, tasks: str = TASKS) -> tuple[list, list]:
    """(prompts, their SamplingParams) of a workload."""
    from pagedllm import SamplingParams

    if name == "grounded":
        with open(tasks) as f:
            tasks = json.load(f)
        prompts = [[{"role": "user", "content": f"{t['task']}\n\n{t['text']}"}] for t in tasks]
        return prompts, [SamplingParams(temperature=0, max_tokens=max_tokens)] * len(prompts)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(64)]} for _ in range(num_prompts)]
    return prompts, [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True) for i in range(num_prompts)
    ]


def run_chunk(llm, prompts: list, params: list) -> list[list[int]]:
    """The output tokens of requests submitted together."""
    if isinstance(prompts[0], list):  # conversations (one SamplingParams for all: the grounded workload's)
        results = llm.chat(prompts, params[0], use_tqdm=False)
    else:
        results = llm.generate(prompts, params, use_tqdm=False)
    return [r.outputs[0].token_ids for r in results]


def run_round(engines: dict, prompts: list, params: list, batch: int, round_: int) -> tuple[dict, dict]:
    """Each engine's output tokens/s over the requests and its outputs. The engines take each chunk
    of `batch` requests in turn (which goes first alternates), so that the machine's drift between
    them (its bandwidth swings within minutes) falls on both alike."""
    seconds = {name: 0.0 for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for c, i in enumerate(range(0, len(prompts), batch)):
        names = list(engines) if (round_ + c) % 2 == 0 else list(reversed(engines))
        for name in names:
            start = time.perf_counter()
            outputs[name] += run_chunk(engines[name], prompts[i : i + batch], params[i : i + batch])
            seconds[name] += time.perf_counter() - start
    return {name: sum(map(len, outputs[name])) / seconds[name] for name in engines}, outputs


def steps_with_perfect_drafts(prompt_ids: list[list[int]], outputs: list[list[int]], proposer) -> int:
    """Decode steps the requests would take at batch 1 if each of the lookup's proposals were cut to
    exactly the drafts the target accepts: the fewest this proposer allows."""
    steps = 0
    for prompt, output in zip(prompt_ids, outputs):
        i = 1  # the first output token comes with the prefill
        while i < len(output):
            drafts = proposer.propose(prompt + output[:i])
            accepted = next(
                (j for j, (d, t) in enumerate(zip(drafts, output[i:])) if d != t), min(len(drafts), len(output) - i)
            )
            steps, i = steps + 1, i + accepted + 1
    return steps


def ngram_bound(llm, prompts: list, outputs: list[list[int]], plain_rate: float, proposer) -> str:
    """The most n-gram speculation could give this workload at batch 1 with perfect drafts and
    verification rows as cheap as a decode step's one: the plain engine's time (its prefill, timed
    here, and its decode steps) over its prefill and the fewer steps."""
    from pagedllm import SamplingParams

    start = time.perf_counter()
    results = llm.chat(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    prefill = time.perf_counter() - start
    tokens = sum(map(len, outputs))
    step = (tokens / plain_rate - prefill) / (tokens - len(outputs))
    steps = steps_with_perfect_drafts([r.prompt_token_ids for r in results], outputs, proposer)
    bound = (prefill + (tokens - len(outputs)) * step) / (prefill + steps * step)
    return (
        f"bound (perfect drafts, free verification rows): {bound:.2f}x; {steps} decode steps for "
        f"{tokens - len(outputs)} tokens, prefill {prefill:.2f} s, a step {step * 1e3:.1f} ms"
    )


def first_differences(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    """Per output pair: the first token index where they differ, None where equal."""
    return [
        next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None if len(x) == len(y) else min(len(x), len(y)))
        for x, y in zip(a, b)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="none: a GGUF file dequantized at load to --dtype")
    parser.add_argument("--workload", choices=("grounded", "random"), default="grounded")
    parser.add_argument("--batch", type=int, default=1, help="requests submitted at once")
    parser.add_argument(
        "--tasks",
        default=TASKS,
        help="grounded: the task file (benchmarks/data/grounded_long_tasks.json: "
        "the same kinds of edits on texts 3x longer)",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="random: default 6, or 2 x --batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=None, help="default 160 (grounded), 128 (random)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    parser.add_argument("--draft-model", default=None, help="draft_model: its path (default: the default model's file)")
    parser.add_argument("--draft-quantization", default=None, help="draft_model: as --quantization, for the draft")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    args = parser.parse_args()

    from pagedllm import LLM

    if args.method == "ngram":
        spec_config = {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min,
        }
    else:
        from pagedllm.models.loader import resolve_model_path

        spec_config = {
            "model": args.draft_model or resolve_model_path(args.model),
            "num_speculative_tokens": args.k,
            "quantization": args.draft_quantization,
        }
    common = dict(enable_prefix_caching=False, dtype=args.dtype, quantization=args.quantization)
    engines = {"plain": LLM(args.model, **common), "spec": LLM(args.model, speculative_config=spec_config, **common)}
    num_prompts = args.num_prompts or (6 if args.batch == 1 else 2 * args.batch)
    max_tokens = args.max_tokens or (160 if args.workload == "grounded" else 128)
    prompts, params = workload(
        args.workload, engines["plain"].engine.model_config.vocab_size, num_prompts, max_tokens, args.tasks
    )
    for llm in engines.values():  # warm-up
        run_chunk(llm, prompts[:1], params[:1])
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        round_rates, outputs = run_round(engines, prompts, params, args.batch, round_)
        for name, rate in round_rates.items():
            rates[name].append(rate)
        diffs = first_differences(outputs["plain"], outputs["spec"])
        print(
            f"round {round_}: plain {rates['plain'][-1]:.1f} tok/s, {args.method} {rates['spec'][-1]:.1f} tok/s, "
            f"ratio {rates['spec'][-1] / rates['plain'][-1]:.2f}; outputs equal "
            f"{diffs.count(None)}/{len(diffs)}, the others first differ at tokens "
            f"{[d for d in diffs if d is not None]}"
        )
    stats = engines["spec"].engine.stats()
    ratios = [b / a for a, b in zip(rates["plain"], rates["spec"])]
    print(
        f"median: plain {statistics.median(rates['plain']):.1f} tok/s, "
        f"{args.method} {statistics.median(rates['spec']):.1f} "
        f"tok/s, ratio {statistics.median(ratios):.2f}"
    )
    print(
        f"drafts {stats.spec_num_drafts}, draft tokens {stats.spec_num_draft_tokens}, accepted "
        f"{stats.spec_num_accepted_tokens} "
        f"({stats.spec_num_accepted_tokens / max(stats.spec_num_draft_tokens, 1):.0%}), "
        f"{stats.spec_num_accepted_tokens / max(stats.spec_num_drafts, 1):.2f} accepted a draft; accepted by "
        f"position {list(stats.spec_accepted_per_position)}"
    )
    if args.method == "ngram" and args.workload == "grounded" and args.batch == 1:
        from pagedllm.spec_decode.ngram import NgramProposer

        proposer = NgramProposer(args.k, args.lookup_min, args.lookup_max)
        print(ngram_bound(engines["plain"], prompts, outputs["plain"], statistics.median(rates["plain"]), proposer))


if __name__ == "__main__":
    main()
