"""What the live dashboard costs the engine: its snapshot (taken in the engine's thread, between
steps) and the step log every step keeps, against the same workload without them, in one process.

    python benchmarks/dashboard_cost.py                      # default model, 64 x 128 in x 128 out
    python benchmarks/dashboard_cost.py --model /tmp/llama-250m --rounds 3

Each round runs the workload twice, in alternating order: plain (the step log's record replaced
by a no-op, no snapshot), and polled (a snapshot every --every seconds of the run, each encoded
to JSON as /dashboard/state sends it, as if a page were open; the server encodes off its event
loop, but on this machine's two cores that still takes from the engine). It prints the ratio of
the two throughputs, and the snapshot's and the encoding's own times with the pool and queue they
covered (the time grows with the number of KV blocks and of requests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from common import fixed_workload


def run(engine, requests, every: float | None, snapshots: list[tuple[float, float, int, int]]) -> float:
    """Output tokens a second over the workload; with `every`, a snapshot that often (its times kept)."""
    from pagedllm import SamplingParams

    for i, (prompt, n) in enumerate(requests):
        engine.add_request(
            f"r{i}-{time.monotonic_ns()}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
    start = last = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        if every is not None and time.perf_counter() - last >= every:
            last = time.perf_counter()
            engine.request_snapshot()
            (snapshot,) = engine.take_snapshots()
            taken = time.perf_counter()
            json.dumps({"replicas": [dataclasses.asdict(snapshot)]})
            snapshots.append((taken - last, time.perf_counter() - taken, len(snapshot.blocks), len(snapshot.requests)))
    return sum(n for _, n in requests) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--every", type=float, default=1.0, help="seconds between snapshots (the page polls each second)"
    )
    parser.add_argument("--kv-cache-memory", default=None)
    args = parser.parse_args()

    from pagedllm import LLM

    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory)
    engine = llm.engine
    vocab = min(engine.model_config.vocab_size, len(llm.get_tokenizer()))
    requests = fixed_workload(vocab, count=args.num_prompts, input_len=args.input_len, output_len=args.output_len)
    core = engine.core
    run(engine, requests[:4], None, [])  # warm-up
    log_step = core._log_step
    steps = core.step_log.count
    ratios, snapshots, plain_speeds, polled_speeds = [], [], [], []
    for r in range(args.rounds):
        speeds = {}
        for mode in ("plain", "polled") if r % 2 == 0 else ("polled", "plain"):
            core._log_step = (lambda *a: None) if mode == "plain" else log_step
            speeds[mode] = run(engine, requests, None if mode == "plain" else args.every, snapshots)
        core._log_step = log_step
        plain_speeds.append(speeds["plain"])
        polled_speeds.append(speeds["polled"])
        ratios.append(speeds["polled"] / speeds["plain"])
    steps = (core.step_log.count - steps) / args.rounds  # the polled runs' steps, one a round
    take, encode = (statistics.median(s[k] for s in snapshots) * 1000 for k in (0, 1))
    blocks, queued = max(s[2] for s in snapshots), max(s[3] for s in snapshots)
    print(
        f"model: {engine.model_config.path}; {args.num_prompts} x {args.input_len} in x {args.output_len} out; "
        f"{steps:.0f} steps a run; a snapshot every {args.every} s\n"
    )
    print(
        "| rounds | plain tok/s | polled tok/s | polled / plain | snapshots | snapshot ms (median) | JSON ms (median) "
        "| KV blocks | requests at most |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.rounds} | {', '.join(f'{s:.0f}' for s in plain_speeds)} "
        f"| {', '.join(f'{s:.0f}' for s in polled_speeds)} "
        f"| {', '.join(f'{x:.3f}' for x in ratios)} | {len(snapshots)} | {take:.2f} | {encode:.2f} "
        f"| {blocks} | {queued} |"
    )


if __name__ == "__main__":
    main()
