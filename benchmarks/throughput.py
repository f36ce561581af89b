"""Offline throughput: every request submitted at once, greedy, EOS ignored.

    python benchmarks/throughput.py --model /tmp/llama-250m --workload fixed --baseline hf
    python benchmarks/throughput.py --workload all            # default model, all three workloads

Workloads: fixed (64 x 128 in x 128 out; --num-prompts, --input-len and --output-len change it),
variable (200 requests, heavy-tailed lengths, input
4..1024, output 4..512), shared (64 requests sharing a 512-token prefix, 32 own tokens, 128 out).
--baseline hf runs transformers `generate` on the same model and requests in the same process
(static batches, left padding, prompts sorted by length; only requested tokens count as output;
the batch size the fastest found for the workload, or --hf-batch-size)
and prints our speed as a ratio of it. --engine vllm drives vLLM's offline API instead of ours,
when the `vllm` package is importable (see ../shared/peers/README.md for its setup). For the
fixed and variable workloads it also prints output tokens/s as a share of this machine's compute
roofline: the workload's FLOPs at the matmul rate it measures, counted as issue 5 counts them (every
token through every matrix, the output head included, and causal attention); not for the shared
workload, whose prefix is computed once, not once a request.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from common import (
    WORKLOADS,
    PeakTracker,
    attention_flops,
    fixed_workload,
    matmul_flops_per_token,
    measure_matmul_gflops,
)
from pagedllm.benchmarks.throughput import measure as run_pagedllm


def run_vllm(llm, requests: list[tuple[list[int], int]]) -> float:
    import vllm

    params = [vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
    return time.perf_counter() - start


# transformers' fastest static batch size per workload on the 250M model, found by trying 16 to 128
# with --hf-batch-size (the sizes from 24 to 64 are within this machine's noise of each other).
HF_BATCH_SIZE = {"fixed": 64, "variable": 24, "shared": 32}


def run_hf(model, requests: list[tuple[list[int], int]], batch_size: int) -> float:
    order = sorted(requests, key=lambda r: len(r[0]))
    start = time.perf_counter()
    for i in range(0, len(order), batch_size):
        batch = order[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        n = max(out for _, out in batch)
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
    return time.perf_counter() - start


def load_hf(model_config, dtype: torch.dtype):
    import os

    from transformers import AutoModelForCausalLM

    path = model_config.path
    kwargs = {"gguf_file": os.path.basename(path)} if model_config.is_gguf else {}
    folder = os.path.dirname(path) if model_config.is_gguf else path
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()


def roofline_tok_s(model, config, requests, gflops: float) -> float:
    """Output tokens/s if every FLOP of the workload ran at the measured matmul rate."""
    per_token = matmul_flops_per_token(model)
    total = 0
    for prompt, out in requests:
        tokens = len(prompt) + out
        total += per_token * tokens + sum(attention_flops(config, c) for c in range(1, tokens + 1))
    return sum(out for _, out in requests) / (total / (gflops * 1e9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="fixed")
    parser.add_argument("--engine", choices=["pagedllm", "vllm"], default="pagedllm")
    parser.add_argument("--baseline", choices=["none", "hf"], default="none")
    parser.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="transformers' static batch size (default: the fastest found for the workload)",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        nargs="+",
        default=[64],
        help="fixed workload only: run it with each of these request counts",
    )
    parser.add_argument("--input-len", type=int, default=128, help="fixed workload only")
    parser.add_argument("--output-len", type=int, default=128, help="fixed workload only")
    parser.add_argument("--compile", action="store_true", help="our engine's --compile")
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        help="our engine's --kv-cache-dtype; several: a fresh engine for each, in turn, each "
        "workload run with every one before the next",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from pagedllm import LLM
    from pagedllm.models.loader import load_model_config
    from pagedllm.models.registry import model_class
    from pagedllm.tokenizer import load_tokenizer

    model_config = load_model_config(args.model, args.dtype, None, "cpu")
    dtype = getattr(torch, model_config.dtype)
    gflops = measure_matmul_gflops(dtype)  # before any engine holds threads or memory
    vocab = min(model_config.vocab_size, len(load_tokenizer(model_config)))
    if args.engine == "vllm":
        import vllm

        engines = {"auto": vllm.LLM(model=model_config.path, dtype=str(dtype).removeprefix("torch."))}
    else:
        engines = {
            kv: LLM(args.model, dtype=args.dtype, compile=args.compile, kv_cache_dtype=kv) for kv in args.kv_cache_dtype
        }
    with torch.device("meta"):  # the model's shapes, for its FLOPs, without its weights
        shapes = model_class(model_config.hf_config)(model_config.hf_config, 1)
    trackers = {kv: PeakTracker(llm.engine) for kv, llm in engines.items()} if args.engine == "pagedllm" else {}
    run = run_vllm if args.engine == "vllm" else run_pagedllm
    for llm in engines.values():
        for batch in (2, 1):  # warm-up (and, with --compile, its compiling for batches and single rows)
            run(llm, [([5] * 8, 4)] * batch)
    hf = load_hf(model_config, dtype) if args.baseline == "hf" else None
    rows = []
    runs = []
    for name in WORKLOADS if args.workload == "all" else [args.workload]:
        if name == "fixed":
            runs += [
                (name, fixed_workload(vocab, count=n, input_len=args.input_len, output_len=args.output_len))
                for n in args.num_prompts
            ]
        else:
            runs.append((name, WORKLOADS[name](vocab)))
    for (name, requests), kv in ((r, kv) for r in runs for kv in engines):
        tracker = trackers.get(kv)
        if tracker:
            tracker.reset()
        seconds = run(engines[kv], requests)
        out_tokens = sum(n for _, n in requests)
        all_tokens = out_tokens + sum(len(p) for p, _ in requests)
        row = {
            "workload": name,
            "engine": args.engine,
            "dtype": str(dtype).removeprefix("torch."),
            "kv_cache_dtype": kv,
            "requests": len(requests),
            "seconds": seconds,
            "requests_s": len(requests) / seconds,
            "output_tok_s": out_tokens / seconds,
            "total_tok_s": all_tokens / seconds,
        }
        if tracker:
            row["kv_waste_at_peak_pct"] = 100 * tracker.waste_at_peak
        if name != "shared":
            row["roofline_pct"] = (
                100 * row["output_tok_s"] / roofline_tok_s(shapes, model_config.hf_config, requests, gflops)
            )
        if hf is not None:
            hf_batch = args.hf_batch_size or HF_BATCH_SIZE[name]
            row["hf_output_tok_s"] = out_tokens / run_hf(hf, requests, hf_batch)
            row["hf_batch_size"] = hf_batch
            row["x_hf"] = row["output_tok_s"] / row["hf_output_tok_s"]
        rows.append(row)
    print(f"matmul {str(dtype).removeprefix('torch.')}: {gflops:.0f} GFLOP/s measured\n")
    print(
        "| workload | engine | dtype | KV cache | requests | req/s | output tok/s | total tok/s | roofline "
        "| KV waste at peak | HF output tok/s | x HF |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        roofline = f"{r['roofline_pct']:.0f}%" if "roofline_pct" in r else ""
        hf_tok_s = f"{r['hf_output_tok_s']:.1f} (batch {r['hf_batch_size']})" if "x_hf" in r else ""
        x_hf = f"{r['x_hf']:.2f}" if "x_hf" in r else ""
        waste = f"{r['kv_waste_at_peak_pct']:.1f}%" if "kv_waste_at_peak_pct" in r else ""
        print(
            f"| {r['workload']} | {r['engine']} | {r['dtype']} | {r['kv_cache_dtype']} | {r['requests']} | "
            f"{r['requests_s']:.2f} | "
            f"{r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} | {roofline} | {waste} | {hf_tok_s} | {x_hf} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
