"""Perplexity and teacher-forced top-1 agreement on a fixed English text: pagedllm on a GGUF file's
quantized weights, pagedllm on the same weights dequantized to bf16, and llama.cpp on the file.

    ~/peers/llamacpp/bin/python benchmarks/perplexity.py                      # the default model
    ~/peers/llamacpp/bin/python benchmarks/perplexity.py --gguf /tmp/llama-250m-Q4_K_M.gguf

Run it with the Python of llama.cpp's venv, where pagedllm is installed too (../shared/peers/README.md).
The text (benchmarks/data/essay.txt, written for this project: 2,204 words, 2,531 tokens of the
default model's tokenizer) is tokenized once with pagedllm's tokenizer and the same ids go to
every engine, in windows of --ctx tokens evaluated from scratch; each position but a window's first
predicts the next token. Perplexity is exp of the mean negative log-likelihood over those
positions; agreement is the share of positions where an engine's most likely next token is
llama.cpp's.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

TEXT = Path(__file__).resolve().parent / "data" / "essay.txt"


def windows(ids: list[int], ctx: int) -> list[list[int]]:
    return [ids[i:i + ctx] for i in range(0, len(ids), ctx) if len(ids[i:i + ctx]) > 1]


def pagedllm_scores(path: str, quantization: str, chunks: list[list[int]]) -> tuple[list[float], list[int]]:
    """Per predicted position: the log-likelihood of the actual next token and the argmax token."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(path, quantization=quantization, kv_cache_memory="1GiB", max_model_len=max(map(len, chunks)) + 8,
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    nll, best = [], []
    for chunk, output in zip(chunks, outputs):
        for token, entry in zip(chunk[1:], output.prompt_logprobs[1:]):
            nll.append(entry[token].logprob)
            best.append(next(t for t, lp in entry.items() if lp.rank == 1))
    del llm
    return nll, best


def llamacpp_scores(path: str, chunks: list[list[int]], threads: int) -> tuple[list[float], list[int]]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=max(map(len, chunks)), n_batch=512, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    nll, best = [], []
    for chunk in chunks:
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[:len(chunk)], dtype=np.float64)
        logprobs = logits - logits.max(-1, keepdims=True)
        logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
        nll += [float(logprobs[i, chunk[i + 1]]) for i in range(len(chunk) - 1)]
        best += [int(i) for i in logprobs[:-1].argmax(-1)]
    return nll, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="default: the default model's file")
    parser.add_argument("--ctx", type=int, default=1024, help="tokens a window")
    args = parser.parse_args()
    from pagedllm.engine.core_client import physical_cores
    from pagedllm.models.loader import default_model_path, load_model_config, load_tokenizer

    path = args.gguf or default_model_path()
    tokenizer = load_tokenizer(load_model_config(path, "auto", None, "cpu", "none"))
    ids = tokenizer.encode(TEXT.read_text())
    chunks = windows(ids, args.ctx)
    results = {"pagedllm (quantized)": pagedllm_scores(path, "gguf", chunks),
               "pagedllm (dequantized, bf16)": pagedllm_scores(path, "none", chunks),
               "llama.cpp": llamacpp_scores(path, chunks, physical_cores())}
    reference_ppl = math.exp(-np.mean(results["llama.cpp"][0]))
    reference_best = np.array(results["llama.cpp"][1])
    print(f"{Path(path).name}: {len(ids)} tokens in {len(chunks)} windows of up to {args.ctx}, "
          f"{len(reference_best)} predictions\n")
    print("| engine | perplexity | / llama.cpp's | top-1 agreement with llama.cpp |")
    print("|---|---|---|---|")
    for name, (nll, best) in results.items():
        ppl = math.exp(-np.mean(nll))
        agree = float((np.array(best) == reference_best).mean())
        print(f"| {name} | {ppl:.3f} | {ppl / reference_ppl:.4f} | {agree:.2%} |")


if __name__ == "__main__":
    main()
