"""pagedllm against llama.cpp on GGUF files of several quantization types, in one process, rounds
alternated, and pagedllm's peak memory against the file's size plus its KV budget.

Run it with the Python of llama.cpp's venv, where pagedllm is installed too (../shared/peers/README.md,
BENCHMARKS.md), on files llama.cpp's own quantizer made (benchmarks/quantize_gguf.py):

    ~/peers/llamacpp/bin/python benchmarks/gguf_types.py --rounds 3 \
        --gguf /tmp/llama-250m-Q2_K.gguf /tmp/llama-250m-Q3_K_M.gguf /tmp/llama-250m-IQ4_NL.gguf

Per file: the share of its weights in each type; batch-1 decode (--new-tokens greedy tokens after a
32-token prompt) and batched throughput (--batch requests x --input-len in x --output-len out, all
at once), each engine in turn for --rounds rounds, each round's pagedllm/llama.cpp ratio; and, in
a process of its own, pagedllm's peak resident memory over a load and one batched run, against
the file's bytes + the KV budget (--kv-cache-memory) + 400 MB.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llamacpp import LlamaCpp, Ours  # noqa: E402

ALLOWANCE_MB = 400  # the allowance over file + KV budget


def type_shares(path: str) -> dict[str, float]:
    """Each tensor type's share of the file's matrix elements."""
    import gguf

    counts: collections.Counter[str] = collections.Counter()
    for tensor in gguf.GGUFReader(path).tensors:
        if len(tensor.shape) >= 2:
            counts[tensor.tensor_type.name] += int(tensor.n_elements)
    total = sum(counts.values())
    return {name: count / total for name, count in counts.most_common()}


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def peak_memory(path: str, kv_cache_memory: str, batch: int, input_len: int, output_len: int) -> dict:
    """pagedllm alone in a fresh process: peak RSS (MB) over a load and one batched run."""
    command = [sys.executable, __file__, "--memory-of", path, "--kv-cache-memory", kv_cache_memory]
    command += ["--batch", str(batch), "--input-len", str(input_len), "--output-len", str(output_len)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def high_water_mb() -> float:
    """This process's peak resident memory (VmHWM: since its exec; getrusage's maxrss would carry the
    parent's from before it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def memory_child(args: argparse.Namespace) -> None:
    from pagedllm.config import parse_memory

    engine = Ours(args.memory_of, "gguf", 2048, kv_cache_memory=args.kv_cache_memory)
    loaded = high_water_mb()
    engine.batch(prompts(engine.engine.model_config.vocab_size, args.batch, args.input_len, 1), args.output_len)
    peak = high_water_mb()
    kv_mb = parse_memory(args.kv_cache_memory, 0) / 2**20  # the budget the engine was given
    print(json.dumps({"loaded_mb": loaded, "peak_mb": peak, "kv_mb": kv_mb}))


def bench_file(path: str, args: argparse.Namespace, threads: int) -> None:
    shares = type_shares(path)
    engines = {"pagedllm": Ours(path, "gguf", 2048), "llama.cpp": LlamaCpp(path, threads, 2048)}
    vocab = engines["pagedllm"].engine.model_config.vocab_size
    for engine in engines.values():
        engine.first_and_decode(prompts(vocab, 1, 8, 0)[0], 4)  # warm-up
    decode: dict[str, list[float]] = {name: [] for name in engines}
    batched: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        for name, engine in engines.items():
            decode[name].append(engine.first_and_decode(prompts(vocab, 1, 32, round_)[0], args.new_tokens)[1])
        if args.batch:
            batch = prompts(vocab, args.batch, args.input_len, 100 + round_)
            for name, engine in engines.items():
                batched[name].append(engine.batch(batch, args.output_len))
    size_mb = os.path.getsize(path) / 2**20
    print(f"\n### {Path(path).name} ({size_mb:.0f} MiB): " + ", ".join(f"{t} {s:.0%}" for t, s in shares.items()))
    print("\n| measure | pagedllm (median; rounds) | llama.cpp (median; rounds) | ratio (median; rounds) |")
    print("|---|---|---|---|")
    for label, table in (("batch-1 decode tok/s", decode), (f"{args.batch} requests output tok/s", batched)):
        if not table["pagedllm"]:
            continue
        ours, theirs = table["pagedllm"], table["llama.cpp"]
        ratios = [a / b for a, b in zip(ours, theirs)]
        print(
            f"| {label} | {statistics.median(ours):.1f} ({min(ours):.1f}-{max(ours):.1f}) | "
            f"{statistics.median(theirs):.1f} ({min(theirs):.1f}-{max(theirs):.1f}) | "
            f"{statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)}) |"
        )
    del engines
    if args.memory:
        m = peak_memory(path, args.kv_cache_memory, args.batch or 64, args.input_len, args.output_len)
        bound = size_mb + m["kv_mb"] + ALLOWANCE_MB
        print(
            f"\npagedllm peak RSS {m['peak_mb']:.0f} MiB (after load {m['loaded_mb']:.0f}) against file "
            f"{size_mb:.0f} + KV {m['kv_mb']:.0f} + {ALLOWANCE_MB} = {bound:.0f} MiB: "
            f"{'within' if m['peak_mb'] <= bound else 'OVER'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", nargs="+", default=[])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64, help="requests of the batched runs (0: skip them)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory runs")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)  # the peak-memory child
    args = parser.parse_args()
    if args.memory_of:
        return memory_child(args)
    if not args.gguf:
        parser.error("--gguf FILE [FILE ...] is required")
    from pagedllm.executor.cpu_binding import physical_cores

    print(f"pagedllm against llama.cpp, {args.rounds} alternated rounds a measure, {physical_cores()} threads each")
    for path in args.gguf:
        bench_file(path, args, physical_cores())


if __name__ == "__main__":
    main()
