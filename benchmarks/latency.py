"""Batch-1 latency: decode tokens/s and time to first token, against this machine's roofline.

    python benchmarks/latency.py --model /tmp/llama-250m --baseline hf

--engine vllm measures vLLM's offline API the same way, when the `vllm` package is importable
(../shared/peers/README.md says how; prefix caching off, so that no prompt finds another's
blocks). It steps no engine from outside, so there the time to first token is a whole
generate() of one token, and decode speed is (new tokens - 1) over the rest of a generate() of
all of them. --engine llamacpp measures llama.cpp (the `llama_cpp` package of llama-cpp-python) on
a GGUF of the same weights (--gguf; BENCHMARKS.md says how to convert the folder): one request
after another through its `generate`, greedy, timed at each token it yields.

It measures the machine (bf16/fp32 matmul rate), then one request at a time: time to first
token for a 32- and a 1,024-token prompt (the median of five requests each), and decode speed
over 256 new tokens. Decode is
memory-bound at batch 1: every step reads all weights once, so the roofline is bandwidth /
weight bytes per token, and the script prints decode speed as a share of it. The bandwidth this
shared machine gives moves with its neighbours' load (40-67 GB/s within minutes), so it is
measured right before and right after each of a few decode rounds, and each round's share is
its decode speed over the roofline of the mean of the two; the table shows the median round.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import time

import torch

from common import gguf_weight_bytes_per_token, measure_bandwidth_gbs, measure_matmul_gflops, weight_bytes_per_token


def ttft_and_decode(engine, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, decode tokens/s after it) for one request alone."""
    from pagedllm import SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    start = time.perf_counter()
    engine.add_request(None, prompt, params)
    first = None
    while engine.has_unfinished_requests():
        if engine.step() and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - start, (new_tokens - 1) / (end - first) if new_tokens > 1 else 0.0


def vllm_ttft_and_decode(llm, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    import vllm

    def generate(n: int) -> float:
        params = vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start

    first = generate(1)
    return first, (new_tokens - 1) / (generate(new_tokens) - first) if new_tokens > 1 else 0.0


def llamacpp_ttft_and_decode(llm, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    llm.reset()  # no prefix of an earlier request's KV cache is reused
    start = time.perf_counter()
    first = end = None
    for count, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0), start=1):
        end = time.perf_counter()  # the token is sampled; the next one is computed when asked for
        first = first or end
        if count == new_tokens:
            break
    return first - start, (new_tokens - 1) / (end - first) if new_tokens > 1 else 0.0


def hf_decode(model, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return (new_tokens - 1) / (time.perf_counter() - start - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5, help="decode rounds, each between two bandwidth readings")
    parser.add_argument("--engine", choices=["pagedllm", "vllm", "llamacpp"], default="pagedllm")
    parser.add_argument("--gguf", default=None, help="--engine llamacpp: the GGUF file of --model's weights")
    parser.add_argument("--baseline", choices=["none", "hf"], default="none")
    parser.add_argument("--compile", action="store_true", help="our engine's --compile")
    parser.add_argument("--quantization", default=None, help="our engine's --quantization (auto, gguf, none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from pagedllm import LLM
    from pagedllm.executor.cpu_binding import physical_cores
    from pagedllm.models.loader import load_model_config
    from pagedllm.models.registry import model_class
    from pagedllm.tokenizer import load_tokenizer

    model_config = load_model_config(args.model, args.dtype, None, "cpu", args.quantization)
    dtype = getattr(torch, model_config.dtype)
    if args.engine == "vllm":
        import vllm

        llm = vllm.LLM(model=model_config.path, dtype=str(dtype).removeprefix("torch."), enable_prefix_caching=False)
        measure = functools.partial(vllm_ttft_and_decode, llm)
    elif args.engine == "llamacpp":
        import llama_cpp

        if not args.gguf or not os.path.isfile(args.gguf):
            parser.error("--engine llamacpp needs --gguf FILE, the model's weights converted to GGUF")
        threads = physical_cores()  # as our engine's thread count
        llm = llama_cpp.Llama(
            model_path=args.gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False
        )
        measure = functools.partial(llamacpp_ttft_and_decode, llm)
    else:
        engine = LLM(args.model, dtype=args.dtype, compile=args.compile, quantization=args.quantization).engine
        measure = functools.partial(ttft_and_decode, engine)
    if args.engine == "pagedllm":  # the bytes a decode step reads, as loaded (quantized or not)
        weight_bytes = weight_bytes_per_token(engine.model_runner.model)
    elif args.engine == "llamacpp":  # as the file stores them
        weight_bytes = gguf_weight_bytes_per_token(args.gguf)
    else:  # the model's weights as shapes, in the dtype
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            weight_bytes = weight_bytes_per_token(model_class(model_config.hf_config)(model_config.hf_config, 1))
        torch.set_default_dtype(default_dtype)
    rng = random.Random(0)
    vocab = min(model_config.vocab_size, len(load_tokenizer(model_config)))
    prompt = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
    measure(prompt(8), 4)  # warm-up

    gflops = {d: measure_matmul_gflops(d) for d in (torch.bfloat16, torch.float32)}
    rounds = []
    for _ in range(args.rounds):
        before = measure_bandwidth_gbs()
        _, decode = measure(prompt(32), args.new_tokens)
        bandwidth = (before + measure_bandwidth_gbs()) / 2
        roofline = bandwidth * 1e9 / weight_bytes
        rounds.append(
            {
                "bandwidth_gbs": bandwidth,
                "roofline_tok_s": roofline,
                "decode_tok_s": decode,
                "decode_roofline_pct": 100 * decode / roofline,
            }
        )
    median = sorted(rounds, key=lambda r: r["decode_roofline_pct"])[len(rounds) // 2]
    bandwidth, roofline, decode = (median[k] for k in ("bandwidth_gbs", "roofline_tok_s", "decode_tok_s"))
    ttft_short, ttft_long = (statistics.median(measure(prompt(n), 1)[0] for _ in range(5)) for n in (32, 1024))
    weights = (
        "GGUF"
        if args.engine == "llamacpp"
        else "quantized"
        if model_config.quantization
        else str(dtype).removeprefix("torch.")
    )
    result = {
        "engine": args.engine,
        "dtype": weights,
        **median,
        "rounds": rounds,
        "matmul_bf16_gflops": gflops[torch.bfloat16],
        "matmul_fp32_gflops": gflops[torch.float32],
        "weight_mb_per_token": weight_bytes / 1e6,
        "ttft_32_s": ttft_short,
        "ttft_1024_s": ttft_long,
    }
    if args.baseline == "hf":
        from throughput import load_hf

        result["hf_decode_tok_s"] = hf_decode(load_hf(model_config, dtype), prompt(32), args.new_tokens)
    shares = ", ".join(
        f"{r['decode_tok_s']:.1f} tok/s at {r['bandwidth_gbs']:.0f} GB/s = {r['decode_roofline_pct']:.0f}%"
        for r in rounds
    )
    print(f"decode rounds: {shares}")
    print(
        f"machine: read bandwidth {bandwidth:.1f} GB/s (median round), "
        f"matmul bf16 {gflops[torch.bfloat16]:.0f} GFLOP/s, "
        f"fp32 {gflops[torch.float32]:.0f} GFLOP/s"
    )
    print(
        f"model: {weight_bytes / 1e6:.0f} MB of {result['dtype']} weights read per token -> "
        f"batch-1 decode roofline {roofline:.1f} tok/s\n"
    )
    print("| engine | dtype | decode tok/s | % of roofline | TTFT 32 tok | TTFT 1024 tok | HF decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    hf = f"{result['hf_decode_tok_s']:.1f}" if "hf_decode_tok_s" in result else ""
    print(
        f"| {args.engine} | {result['dtype']} | {decode:.1f} | {result['decode_roofline_pct']:.0f}% "
        f"| {ttft_short * 1000:.0f} ms | "
        f"{ttft_long * 1000:.0f} ms | {hf} |"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
