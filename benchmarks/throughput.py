"""Offline throughput: N requests of fixed input/output length, all submitted at once.

    python benchmarks/throughput.py --num-prompts 1 32 --input-len 32 --output-len 128 --baseline hf

Prints a table (and writes JSON with --out). With --baseline hf, transformers' `generate` runs the
same model and workload in the same process, and the table gives our speed as a ratio of its.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist() for _ in range(count)]


def run_pagedllm(llm, prompts: list[list[int]], output_len: int) -> float:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed


def run_hf(model, prompts: list[list[int]], output_len: int) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                       min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def load_hf(model_config, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    path = model_config.path
    if model_config.is_gguf:
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--baseline", choices=["none", "hf"], default="none")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    from pagedllm import LLM

    llm = LLM(args.model, dtype=args.dtype)
    dtype = llm.engine.model_config.dtype
    vocab = llm.engine.model_config.vocab_size
    run_pagedllm(llm, make_prompts(vocab, 2, 8, 99), 4)  # warm-up: kernels loaded, caches touched
    hf = load_hf(llm.engine.model_config, dtype) if args.baseline == "hf" else None
    rows = []
    for count in args.num_prompts:
        prompts = make_prompts(vocab, count, args.input_len, seed=count)
        ours = run_pagedllm(llm, prompts, args.output_len)
        row = {"num_prompts": count, "input_len": args.input_len, "output_len": args.output_len,
               "dtype": str(dtype).removeprefix("torch."), "seconds": ours,
               "output_tok_s": count * args.output_len / ours, "requests_s": count / ours}
        if hf is not None:
            theirs = run_hf(hf, prompts, args.output_len)
            row["hf_output_tok_s"] = count * args.output_len / theirs
            row["ratio_vs_hf"] = theirs / ours
        rows.append(row)
    print(f"| requests | in | out | dtype | output tok/s | requests/s |" + (" HF tok/s | x HF |" if hf else ""))
    print("|---|---|---|---|---|---|" + ("---|---|" if hf else ""))
    for r in rows:
        line = (f"| {r['num_prompts']} | {r['input_len']} | {r['output_len']} | {r['dtype']} | "
                f"{r['output_tok_s']:.1f} | {r['requests_s']:.2f} |")
        if hf:
            line += f" {r['hf_output_tok_s']:.1f} | {r['ratio_vs_hf']:.2f} |"
        print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
