"""Perplexity and teacher-forced top-1 agreement on a fixed English text: pagedllm on a GGUF file's
quantized weights, pagedllm on the same weights dequantized to bf16, and llama.cpp on the file.

    ~/peers/llamacpp/bin/python benchmarks/perplexity.py                      # the default model
    ~/peers/llamacpp/bin/python benchmarks/perplexity.py --gguf /tmp/llama-250m-Q4_K_M.gguf

Run it with the Python of llama.cpp's venv, where pagedllm is installed too (../shared/peers/README.md).
pagedllm runs in each --dtype ("auto": bf16 on this CPU). The text (benchmarks/data/essay.txt,
written for this project: 2,204 words, 2,531 tokens of the
default model's tokenizer) is tokenized once with pagedllm's tokenizer and the same ids go to
every engine, in windows of --ctx tokens evaluated from scratch; each position but a window's first
predicts the next token. Perplexity is exp of the mean negative log-likelihood over those
positions; agreement is the share of positions where an engine's most likely next token is
llama.cpp's, over all positions and over those where llama.cpp's best token leads its second by
at least MARGIN nats (near-ties aside: llama.cpp with an f32 KV cache agrees with its own default
f16 cache on only about 96% of all positions of this text).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

TEXT = Path(__file__).resolve().parent / "data" / "essay.txt"
MARGIN = 0.1  # nats between llama.cpp's best and second-best token, below which a position is a near-tie
MARGINS: list[list[float]] = []  # per llama.cpp run, per position: that gap


def windows(ids: list[int], ctx: int) -> list[list[int]]:
    return [ids[i : i + ctx] for i in range(0, len(ids), ctx) if len(ids[i : i + ctx]) > 1]


def pagedllm_scores(
    path: str, quantization: str, chunks: list[list[int]], dtype: str, kv_cache_dtype: str = "auto"
) -> tuple[list[float], list[int]]:
    """Per predicted position: the log-likelihood of the actual next token and the argmax token."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        path,
        quantization=quantization,
        dtype=dtype,
        kv_cache_memory="1GiB",
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=max(map(len, chunks)) + 8,
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    nll, best = [], []
    for chunk, output in zip(chunks, outputs):
        for token, entry in zip(chunk[1:], output.prompt_logprobs[1:]):
            nll.append(entry[token].logprob)
            best.append(next(t for t, lp in entry.items() if lp.rank == 1))
    del llm
    return nll, best


def llamacpp_scores(path: str, chunks: list[list[int]], threads: int, kv: str) -> tuple[list[float], list[int]]:
    import llama_cpp

    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[kv]
    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=max(map(len, chunks)),
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        type_k=kv_type,
        type_v=kv_type,
        verbose=False,
    )
    nll, best, margins = [], [], []
    for chunk in chunks:
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[: len(chunk)], dtype=np.float64)
        logprobs = logits - logits.max(-1, keepdims=True)
        logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
        nll += [float(logprobs[i, chunk[i + 1]]) for i in range(len(chunk) - 1)]
        best += [int(i) for i in logprobs[:-1].argmax(-1)]
        top2 = np.sort(logprobs[:-1], axis=-1)[:, -2:]
        margins += list(top2[:, 1] - top2[:, 0])
    MARGINS.append(margins)
    return nll, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="default: the default model's file")
    parser.add_argument("--ctx", type=int, default=1024, help="tokens a window")
    parser.add_argument(
        "--dtype", nargs="+", default=["auto"], help="pagedllm's dtypes to run (auto, float32, bfloat16)"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=[],
        help="also pagedllm quantized with these KV caches (fp8, fp8_e5m2): prompts attend through it",
    )
    parser.add_argument(
        "--llamacpp-kv",
        nargs="+",
        default=["f16"],
        choices=["f16", "f32"],
        help="llama.cpp's KV cache types to run (f16: its default); the first is the reference",
    )
    args = parser.parse_args()
    from pagedllm.executor.cpu_binding import physical_cores
    from pagedllm.models.loader import default_model_path, load_model_config
    from pagedllm.tokenizer import load_tokenizer

    path = args.gguf or default_model_path()
    tokenizer = load_tokenizer(load_model_config(path, "auto", None, "cpu", "none"))
    ids = tokenizer.encode(TEXT.read_text())
    chunks = windows(ids, args.ctx)
    results = {}
    for dtype in args.dtype:
        results[f"pagedllm quantized, {dtype}"] = pagedllm_scores(path, "gguf", chunks, dtype)
        results[f"pagedllm dequantized, {dtype}"] = pagedllm_scores(path, "none", chunks, dtype)
        for kv in args.kv_cache_dtype:
            results[f"pagedllm quantized, {dtype}, KV {kv}"] = pagedllm_scores(path, "gguf", chunks, dtype, kv)
    for kv in args.llamacpp_kv:
        results[f"llama.cpp, KV {kv}"] = llamacpp_scores(path, chunks, physical_cores(), kv)
    reference = results[f"llama.cpp, KV {args.llamacpp_kv[0]}"]
    reference_ppl = math.exp(-np.mean(reference[0]))
    reference_best = np.array(reference[1])
    clear = np.array(MARGINS[0]) >= MARGIN  # positions where the reference's pick is no near-tie
    print(
        f"{Path(path).name}: {len(ids)} tokens in {len(chunks)} windows of up to {args.ctx}, "
        f"{len(reference_best)} predictions\n"
    )
    print(
        f"| engine | perplexity | / llama.cpp's (KV {args.llamacpp_kv[0]}) | top-1 agreement with it | "
        f"where its top two are >= {MARGIN} nats apart ({clear.mean():.1%} of positions) |"
    )
    print("|---|---|---|---|---|")
    for name, (nll, best) in results.items():
        ppl = math.exp(-np.mean(nll))
        same = np.array(best) == reference_best
        print(f"| {name} | {ppl:.3f} | {ppl / reference_ppl:.4f} | {same.mean():.2%} | {same[clear].mean():.2%} |")


if __name__ == "__main__":
    main()
