"""Each engine step against its own bound: how near a workload runs to this machine's limits.

    python benchmarks/step_bound.py --model /tmp/llama-250m --workload variable

Runs the workload through our engine once (all requests at once, greedy, EOS ignored, as
throughput.py does) and records every step's work and wall time. A step's bound is the longer of
its arithmetic at the bf16 dot-product peak (linear layers on every computed token, the output head
on every sampled row, QK and PV of each query token over its context) and its memory traffic at
the read bandwidth (every weight once, and each KV block its tokens attend to once, however many
requests share it). Both limits are
measured before and after the run, and the higher reading of each is used (neighbours' load only
lowers them). No engine can run a step faster than its bound on this machine, so the sum
of the bounds over the steps caps the output tokens/s this schedule can reach; the schedule itself
(which requests share a step) is the engine's own and the same for any engine that keeps every
request running from the start. A second, tighter bound takes the linear layers and attention in
turn, each at its own limit (the weights' arithmetic or their bytes, then attention's arithmetic
or its K/V bytes), as an engine that runs a layer's operators one after another can at best.
Steps are grouped by kind, and each group's time is set against both bounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from common import (
    WORKLOADS,
    attention_flops,
    head_dim,
    matmul_flops_per_token,
    measure_bandwidth_gbs,
    measure_bf16_dot_peak_gflops,
    weight_bytes_per_token,
)


@dataclasses.dataclass
class StepWork:
    tokens: int  # computed this step (prompt chunks and decodes)
    sampled: int  # rows through the output head
    prefill: bool  # some request computes more than one token
    decodes: int  # requests computing one token
    attended: int  # sum over query tokens of the context each attends to
    kv_tokens: int  # tokens in the distinct KV blocks the step reads (a shared block counts once)
    seconds: float


@dataclasses.dataclass
class StepRecord:
    """What the scheduler asked of one step, kept as it was: (tokens computed, start position,
    sampled, the blocks holding its context) a request."""

    requests: list[tuple[int, int, bool, list[int]]]
    seconds: float = 0.0

    def work(self, block_size: int) -> StepWork:
        tokens = sampled = decodes = attended = 0
        filled: dict[int, int] = {}  # block -> tokens of it some request reads
        for n, start, sample, blocks in self.requests:
            tokens, sampled, decodes = tokens + n, sampled + sample, decodes + (n == 1)
            attended += n * start + n * (n + 1) // 2
            for i, block in enumerate(blocks):
                filled[block] = max(filled.get(block, 0), min(block_size, start + n - i * block_size))
        return StepWork(
            tokens, sampled, decodes < len(self.requests), decodes, attended, sum(filled.values()), self.seconds
        )


def record_steps(engine) -> list[StepRecord]:
    """Wrap the engine's step so that each one's request and wall time are appended to the list
    returned (the work is counted after the run, off the timed path)."""
    steps: list[StepRecord] = []
    schedule, step = engine.core.scheduler.schedule, engine.step
    block_size = engine.args.block_size

    def context_blocks(r) -> list[int]:
        """The blocks holding the request's tokens up to the step's last (the scheduler's tables: the
        step's message carries only their changes)."""
        end = r.num_computed_tokens + r.num_new_tokens
        return engine.scheduler.kv.block_ids(r.request_id)[: -(-end // block_size)]

    def recording_schedule():
        output = schedule()
        if not output.is_empty:
            steps.append(
                StepRecord(
                    [(r.num_new_tokens, r.num_computed_tokens, r.sample, context_blocks(r)) for r in output.scheduled]
                )
            )
        return output

    def timed_step():
        start = time.perf_counter()
        outputs = step()
        if steps:
            steps[-1].seconds = time.perf_counter() - start
        return outputs

    engine.core.scheduler.schedule, engine.step = recording_schedule, timed_step
    return steps


KINDS = ("with prefill chunks", "decodes only, more than 128", "decodes only, 33-128", "decodes only, up to 32")


def kind(step: StepWork) -> str:
    if step.prefill:
        return "with prefill chunks"
    if step.decodes > 128:
        return "decodes only, more than 128"
    return "decodes only, 33-128" if step.decodes > 32 else "decodes only, up to 32"


def measure_limits() -> tuple[float, float]:
    """(bf16 dot-product GFLOP/s, read GB/s) on the threads the engine uses."""
    peak = measure_bf16_dot_peak_gflops(torch.get_num_threads())
    if peak is None:
        raise SystemExit("no bf16 dot-product peak here (needs a C compiler and AVX-512 BF16)")
    return peak, measure_bandwidth_gbs()


@dataclasses.dataclass
class Bounds:
    """The model's costs per unit of work and the machine's limits: seconds no step can beat."""

    body_flops: int  # per computed token: every linear layer but the output head
    head_flops: int  # per sampled row
    weight_bytes: int  # read once a step
    kv_bytes: int  # per token of context a step attends to
    config: object  # the model's Hugging Face config, for attention's FLOPs
    peak_gflops: float
    bandwidth_gbs: float

    @classmethod
    def of(cls, engine, peak_gflops: float, bandwidth_gbs: float) -> Bounds:
        model, config = engine.model_runner.model, engine.model_config.hf_config
        head = 2 * model.lm_head.weight.numel()
        kv_bytes = (
            2
            * config.num_hidden_layers
            * config.num_key_value_heads
            * head_dim(config)
            * getattr(torch, engine.model_config.dtype).itemsize
        )
        return cls(
            matmul_flops_per_token(model) - head,
            head,
            weight_bytes_per_token(model),
            kv_bytes,
            config,
            peak_gflops,
            bandwidth_gbs,
        )

    def _linear_work(self, step: StepWork) -> tuple[float, float]:
        """(seconds of arithmetic at the peak, seconds of reads at the bandwidth) of the linear layers."""
        return (
            (self.body_flops * step.tokens + self.head_flops * step.sampled) / (self.peak_gflops * 1e9),
            self.weight_bytes / (self.bandwidth_gbs * 1e9),
        )

    def _attention_work(self, step: StepWork) -> tuple[float, float]:
        return (
            attention_flops(self.config, step.attended) / (self.peak_gflops * 1e9),
            self.kv_bytes * step.kv_tokens / (self.bandwidth_gbs * 1e9),
        )

    def linear(self, step: StepWork) -> float:
        return max(self._linear_work(step))

    def attention(self, step: StepWork) -> float:
        return max(self._attention_work(step))

    def step(self, step: StepWork) -> float:
        """Arithmetic and memory traffic each overlapped with the other, across the whole step."""
        linear, attention = self._linear_work(step), self._attention_work(step)
        return max(linear[0] + attention[0], linear[1] + attention[1])


def run_recorded(llm, requests: list[tuple[list[int], int]]) -> tuple[list[StepWork], float]:
    from pagedllm import SamplingParams

    llm.generate([{"prompt_token_ids": [5] * 8}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    records = record_steps(llm.engine)
    start = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests],
        use_tqdm=False,
    )
    elapsed = time.perf_counter() - start
    return [r.work(llm.engine.args.block_size) for r in records], elapsed


def print_table(steps: list[StepWork], bounds: Bounds) -> tuple[float, float, float]:
    """One row per kind of step and one for all; returns all steps' (bound, linear's, attention's)."""
    print("| steps | count | tokens computed | time s | bound s | bound / time | in turn: bound s | bound / time |")
    print("|---|---|---|---|---|---|---|---|")
    for name, group in [(name, [s for s in steps if kind(s) == name]) for name in KINDS] + [("all steps", steps)]:
        if not group:
            continue
        spent = sum(s.seconds for s in group)
        least = sum(bounds.step(s) for s in group)
        linear, attention = sum(bounds.linear(s) for s in group), sum(bounds.attention(s) for s in group)
        print(
            f"| {name} | {len(group)} | {sum(s.tokens for s in group)} | {spent:.2f} | {least:.2f} | "
            f"{least / spent:.0%} | {linear + attention:.2f} | {(linear + attention) / spent:.0%} |"
        )
    return least, linear, attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="variable")
    args = parser.parse_args()

    from pagedllm import LLM
    from pagedllm.tokenizer import load_tokenizer

    limits = [measure_limits()]
    llm = LLM(args.model)
    vocab = min(llm.engine.model_config.vocab_size, len(load_tokenizer(llm.engine.model_config)))
    requests = WORKLOADS[args.workload](vocab)
    steps, elapsed = run_recorded(llm, requests)
    limits.append(measure_limits())
    peak, bandwidth = max(p for p, _ in limits), max(b for _, b in limits)
    out_tokens = sum(n for _, n in requests)
    print(" then ".join(f"bf16 dot-product peak {p:.0f} GFLOP/s, read bandwidth {b:.1f} GB/s" for p, b in limits))
    print(
        f"the bounds take {peak:.0f} GFLOP/s and {bandwidth:.1f} GB/s; "
        f"{len(requests)} requests, {out_tokens} output tokens, {len(steps)} steps\n"
    )
    least, linear, attention = print_table(steps, Bounds.of(llm.engine, peak, bandwidth))
    print(
        f"\noutput tok/s: {out_tokens / elapsed:.1f} (run, {elapsed:.2f} s); at the steps' bound "
        f"{out_tokens / least:.1f}; at the bound in turn {out_tokens / (linear + attention):.1f} "
        f"(linear layers {linear:.2f} s, attention {attention:.2f} s)"
    )


if __name__ == "__main__":
    main()
