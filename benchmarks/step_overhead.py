"""Per-step time outside the model's forward pass, at batch 1 on the default model.

    python benchmarks/step_overhead.py
    python benchmarks/step_overhead.py --model /tmp/llama-250m --batch 64

Times each part of an engine step over 200 decode steps of one request (or --batch requests):
scheduling, taking in the step's deltas and building the batch tensors, the forward pass, the
logits and sampling, the scheduler update, and output processing (detokenizing, stop strings). The
goal is overhead under 10% of the step.
"""

from __future__ import annotations

import argparse
import collections
import time

import common  # noqa: F401  (sets HF_HUB_OFFLINE and quiet progress bars)


def timed(totals: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    args = parser.parse_args()

    from pagedllm import LLM, SamplingParams

    engine = LLM(args.model).engine
    runner = engine.model_runner
    totals: dict[str, float] = collections.defaultdict(float)
    engine.core.scheduler.schedule = timed(totals, "schedule", engine.core.scheduler.schedule)
    engine.core.scheduler.update = timed(totals, "scheduler update", engine.core.scheduler.update)
    engine.output_processor.process = timed(totals, "outputs (detokenize, stops)", engine.output_processor.process)
    batch = runner.input_batch
    batch.update = timed(totals, "batch state (the step's deltas)", batch.update)
    batch.prepare = timed(totals, "batch tensors", batch.prepare)
    runner.model.forward = timed(totals, "forward pass", runner.model.forward)
    runner._sample = timed(totals, "logits + sampling", runner._sample)
    runner.sampler = timed(totals, "  of which sampling", runner.sampler)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 10, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(None, list(range(100 + i, 132 + i)), params)
    for _ in range(10):  # prefill and warm-up, not counted
        engine.step()
    totals.clear()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step = (time.perf_counter() - start) / args.steps
    model = (totals["forward pass"] + totals["logits + sampling"] - totals["  of which sampling"]) / args.steps
    print(f"batch {args.batch}, {args.steps} decode steps: {step * 1000:.2f} ms a step\n")
    print("| part | ms a step | share of step |")
    print("|---|---|---|")
    for name, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {total / args.steps * 1000:.3f} | {100 * total / args.steps / step:.1f}% |")
    overhead = step - model
    print(f"| everything but the model (forward, logits) | {overhead * 1000:.3f} | {100 * overhead / step:.1f}% |")


if __name__ == "__main__":
    main()
