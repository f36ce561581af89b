"""Where a workload's time goes: torch.profiler over one run of a throughput workload.

    python benchmarks/profile_ops.py --model /tmp/llama-250m --workload variable

Prints the operators that take the most of the run's CPU time (self time, so that nothing is
counted twice) and the share of the run outside any operator (Python: scheduling, batch tensors,
sampling bookkeeping, detokenizing). Our kernels show under their own names (pagedllm::*); the
C++ decoder stack calls its kernels itself, so it shows as one (pagedllm::decoder_stack), and
--op-by-op runs the layers without it to see each kernel's share.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common import WORKLOADS
from throughput import run_pagedllm


def label_kernels() -> None:
    """Our C++ kernels are plain functions, not torch operators: name them for the profiler."""
    from pagedllm.kernels import cpu_ops

    ops = cpu_ops()
    if ops is None:
        return
    names = ("paged_attention", "rms_norm", "silu_and_mul", "rotary_and_cache", "packed_linear_rows", "argmax_rows")
    for name in names:
        fn = getattr(ops, name)

        def labelled(*args, _fn=fn, _name=f"pagedllm::{name}"):
            with torch.profiler.record_function(_name):
                return _fn(*args)

        setattr(ops, name, labelled)


class LabelledStack:
    """The model's decoder stack, named for the profiler."""

    def __init__(self, stack) -> None:
        self.stack = stack

    def forward(self, *args):
        with torch.profiler.record_function("pagedllm::decoder_stack"):
            return self.stack.forward(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="fixed")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--op-by-op", action="store_true", help="without the C++ decoder stack")
    args = parser.parse_args()

    from pagedllm import LLM
    from pagedllm.tokenizer import load_tokenizer

    label_kernels()
    llm = LLM(args.model)
    model = llm.engine.model_runner.model
    if model.stack is not None:
        model.stack = None if args.op_by_op else LabelledStack(model.stack)
    vocab = min(llm.engine.model_config.vocab_size, len(load_tokenizer(llm.engine.model_config)))
    requests = WORKLOADS[args.workload](vocab)
    run_pagedllm(llm, [([5] * 8, 4)] * 2)  # warm-up: kernels built, caches touched
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_pagedllm(llm, requests)
    wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    in_ops = sum(e.self_cpu_time_total for e in events) / 1e6
    print(f"{args.workload}: {wall:.2f} s under the profiler, {in_ops:.2f} s inside operators\n")
    print("| operator | calls | self s | share of run |")
    print("|---|---|---|---|")
    for e in events[: args.top]:
        seconds = e.self_cpu_time_total / 1e6
        print(f"| {e.key} | {e.count} | {seconds:.2f} | {100 * seconds / wall:.1f}% |")
    print(f"| (outside operators) | | {wall - in_ops:.2f} | {100 * (wall - in_ops) / wall:.1f}% |")


if __name__ == "__main__":
    main()
