"""Decode steps with the C++ decoder stack against the model's op-by-op path, in one process.

    python benchmarks/decoder_stack.py --model /tmp/llama-250m
    python benchmarks/decoder_stack.py --batch 64 --steps 10

The two paths compute the same thing bit for bit (tests/test_decoder_stack.py); the stack drops
the Python between a layer's kernels. The same running requests step under one path, then the
other, round after round, so that both see the same minutes of this noisy machine; the table
shows each path's ms a step (median and best round) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import common  # noqa: F401  (sets HF_HUB_OFFLINE and quiet progress bars)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    parser.add_argument("--steps", type=int, default=50, help="decode steps a round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each path, alternating")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from pagedllm import LLM, SamplingParams

    engine = LLM(args.model, enable_prefix_caching=False).engine
    model = engine.model_runner.model
    stack = model.stack
    if stack is None:
        raise SystemExit("no decoder stack for this model here (it needs bf16 and the AVX512-BF16 kernels)")
    params = SamplingParams(temperature=0, max_tokens=2 * args.rounds * args.steps + 20, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(None, list(range(100 + i, 132 + i)), params)
    for _ in range(10):  # prefill and warm-up
        engine.step()
    times: dict[str, list[float]] = {"stack": [], "op by op": []}
    for _ in range(args.rounds):
        for name, path in (("stack", stack), ("op by op", None)):
            model.stack = path
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[name].append((time.perf_counter() - start) / args.steps * 1000)
    model.stack = stack
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"batch {args.batch}, {args.rounds} rounds of {args.steps} decode steps each way\n")
    print("| path | ms a step, median round | best round | rounds |")
    print("|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {medians[name]:.2f} | {min(t):.2f} | {', '.join(f'{x:.2f}' for x in t)} |")
    ratio = medians["op by op"] / medians["stack"]
    print(f"\nop by op / stack, medians: {ratio:.3f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"batch": args.batch, "ms_a_step": times, "ratio_of_medians": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
