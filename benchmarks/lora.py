"""LoRA adapters' cost: the same load with and without adapters, in one process.

    python benchmarks/make_model.py --out /tmp/llama-250m
    .venv/bin/python benchmarks/lora.py --model /tmp/llama-250m --rounds 3

Writes 8 random PEFT adapters of rank 16 on every target (q/k/v/o, gate/up/down). Each round runs,
on two engines over the same model (`base`: no --enable-lora, so the C++ decoder stack runs;
`lora`: --enable-lora --max-loras 8), greedy, EOS ignored:
  - throughput: 64 requests x 128 prompt / 128 output tokens, all at once: on `base`; on `lora`
    with no adapter; on `lora` with request i under adapter i % 8;
  - batch-1 decode: one request, 128 prompt tokens, decode tokens/s from 1 and 129 output tokens:
    on `base`, and on `lora` under one adapter.
Prints each round and the medians (range) of the ratios to `base`, and to the `lora` engine's own
base requests (the same code as `base`'s, run right beside them): the issue's targets are >= 0.8
for the 8-adapter throughput and >= 0.9 for batch-1 decode with one adapter. `--busy 0,1` runs each
round quiet, then beside one busy process (`while True: pass`), and prints what each figure keeps.
`--engine vllm` measures vLLM's CPU build the same way (its LoRA engine: enable_lora, max_loras 8),
run with the Python of its venv (pagedllm installed there too, `pip install --no-deps -e .`), the
preloads and core binding of ../shared/peers/README.md, and a `__main__` guard (its engine spawns).
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import Busy, model_hf_config, write_lora_adapter  # benchmarks/, the script's own folder
from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.benchmarks.datasets import fixed_workload

# The engine's sampling parameters: ours, or vLLM's with --engine vllm.
SAMPLING = SamplingParams


def throughput(llm: LLM, requests, loras) -> float:
    params = SAMPLING(temperature=0, max_tokens=requests[0][1], ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False, lora_request=loras)
    return sum(n for _, n in requests) / (time.perf_counter() - start)


def decode_rate(llm: LLM, prompt: list[int], lora) -> float:
    """Decode tokens/s of one request: 128 more tokens over the time a 1-token run takes."""
    seconds = []
    for n in (1, 129):
        params = SAMPLING(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora)
        seconds.append(time.perf_counter() - start)
    return 128 / (seconds[1] - seconds[0])


def measure(base: LLM, lora: LLM, requests, spread, loras) -> dict[str, float]:
    """One round: the load and batch-1 decode on both engines."""
    prompt = requests[0][0]
    return {
        "base tok/s": throughput(base, requests, None),
        "lora engine, no adapter tok/s": throughput(lora, requests, None),
        f"lora engine, {len(loras)} adapters tok/s": throughput(lora, requests, spread),
        "base batch-1 decode tok/s": decode_rate(base, prompt, None),
        "lora engine, batch-1 decode, base tok/s": decode_rate(lora, prompt, None),
        "lora engine, batch-1 decode, one adapter tok/s": decode_rate(lora, prompt, loras[0]),
    }


def ratios(rows: list[dict[str, float]], adapters: int) -> dict[str, list[float]]:
    """The targets' ratios of each round: to `base`, and to the LoRA engine's own base requests (the
    same code as `base`'s, run right beside: less of the machine's noise between the two numbers)."""
    many, one = f"lora engine, {adapters} adapters tok/s", "lora engine, batch-1 decode, one adapter tok/s"
    pairs = {
        f"{adapters} adapters / base, throughput": (many, "base tok/s"),
        "no adapter on the lora engine / base, throughput": ("lora engine, no adapter tok/s", "base tok/s"),
        "one adapter / base, batch-1 decode": (one, "base batch-1 decode tok/s"),
        "no adapter on the lora engine / base, batch-1 decode": (
            "lora engine, batch-1 decode, base tok/s",
            "base batch-1 decode tok/s",
        ),
        f"{adapters} adapters / no adapter, one engine, throughput": (many, "lora engine, no adapter tok/s"),
        "one adapter / no adapter, one engine, batch-1 decode": (one, "lora engine, batch-1 decode, base tok/s"),
    }
    return {name: [row[a] / row[b] for row in rows] for name, (a, b) in pairs.items()}


def spread_of(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def engines(args: argparse.Namespace):
    """The base engine and the LoRA engine, ours or vLLM's (its KV space from VLLM_CPU_KVCACHE_SPACE)."""
    lora = dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    if args.engine == "vllm":
        import vllm

        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        common = dict(model=args.model, dtype=dtype, enable_prefix_caching=False)
        return vllm.LLM(**common), vllm.LLM(**common, **lora)
    common = dict(dtype=args.dtype, kv_cache_memory="2GiB", enable_prefix_caching=False)
    return LLM(args.model, **common), LLM(args.model, **common, **lora)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapter-dir", default="/tmp/pagedllm-lora-bench")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--busy", default="0", help="levels of contention each round: busy processes beside both")
    parser.add_argument("--engine", choices=["pagedllm", "vllm"], default="pagedllm")
    args = parser.parse_args()

    config = model_hf_config(args.model)
    request_class = LoRARequest
    if args.engine == "vllm":
        global SAMPLING
        import vllm
        from vllm.lora.request import LoRARequest as request_class

        SAMPLING = vllm.SamplingParams
    loras = [
        request_class(f"a{i}", i + 1, write_lora_adapter(config, f"{args.adapter_dir}/a{i}", args.rank, i))
        for i in range(args.adapters)
    ]
    base, lora = engines(args)
    requests = fixed_workload(config.vocab_size)
    spread = [loras[i % len(loras)] for i in range(len(requests))]
    for llm in (base, lora):  # warm-up
        throughput(llm, requests[:4], None)
    throughput(lora, requests[:8], spread[:8])
    levels = [int(n) for n in args.busy.split(",")]
    rows: dict[int, list[dict[str, float]]] = {level: [] for level in levels}
    for r in range(args.rounds):
        for level in levels:
            with Busy(level):
                row = measure(base, lora, requests, spread, loras)
            rows[level].append(row)
            print(f"round {r}, {level} busy: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    for level, level_rows in rows.items():
        dtype = base.engine.model_config.dtype if args.engine == "pagedllm" else args.dtype
        print(f"\n{level} busy: medians of {args.rounds} rounds (range), {args.engine}, dtype {dtype}:")
        for key in level_rows[0]:
            print(f"  {key}: {spread_of([row[key] for row in level_rows], 1)}")
        for key, values in ratios(level_rows, len(loras)).items():
            print(f"  {key}: {spread_of(values, 3)}")
        if level:
            for key in level_rows[0]:
                kept = [busy[key] / quiet[key] for busy, quiet in zip(level_rows, rows[levels[0]])]
                print(f"  {key} kept of {levels[0]} busy: {spread_of(kept, 2)}")


if __name__ == "__main__":
    main()
