"""Mixture of experts against a dense model with as many active parameters: batch-1 decode and
32-request throughput, alternated in one process.

    python benchmarks/moe.py                       # writes both random models under /tmp first

Dense: the 250M Llama shape of benchmarks/make_model.py (hidden 1024, 16 layers, MLP 2816, vocab
32000). MoE: the same attention and embeddings, each MLP 16 experts of 1408 with 2 routed a token
(Mixtral's layer; top-2 of 1408 = the dense MLP's 2816), about 1.1B parameters in all and the
dense model's count active. Random bf16 weights. Prints decode tok/s of each, their ratio (the
issue's target: MoE per active parameter within 1.3x of dense, i.e. a ratio >= 0.77), and the same
for 32 concurrent requests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_models(dense_path: str, moe_path: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    from pagedllm.models.loader import default_model_path

    common = dict(
        vocab_size=32000,
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    from make_model import cut_tokenizer

    for path, make in (
        (dense_path, lambda: LlamaForCausalLM(LlamaConfig(intermediate_size=2816, **common))),
        (
            moe_path,
            lambda: MixtralForCausalLM(
                MixtralConfig(intermediate_size=1408, num_local_experts=16, num_experts_per_tok=2, **common)
            ),
        ),
    ):
        if os.path.exists(os.path.join(path, "config.json")):
            continue
        torch.manual_seed(0)
        model = make().to(torch.bfloat16)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        cut_tokenizer(os.path.join(path, "tokenizer.json"), 32000)
        print(f"wrote {path}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
        del model


def decode_tok_s(llm, new_tokens: int) -> float:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(100, 132))}], SamplingParams(max_tokens=1), use_tqdm=False)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": list(range(200, 232))}], params, use_tqdm=False)
    return new_tokens / (time.perf_counter() - start)


def batched_tok_s(llm, requests: int, new_tokens: int) -> float:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(300 + i, 364 + i))} for i in range(requests)]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return requests * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dense", default="/tmp/llama-250m-dense")
    parser.add_argument("--moe", default="/tmp/mixtral-16x1408")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args()
    make_models(args.dense, args.moe)

    from pagedllm import LLM

    engines = {
        name: LLM(path, kv_cache_memory="1GiB", max_model_len=1024)
        for name, path in (("dense", args.dense), ("moe", args.moe))
    }
    decode = {name: [] for name in engines}
    batched = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            decode[name].append(decode_tok_s(llm, args.decode_tokens))
            batched[name].append(batched_tok_s(llm, 32, 32))
    result = {
        "decode_tok_s": {k: [round(x, 1) for x in v] for k, v in decode.items()},
        "batched_tok_s": {k: [round(x, 1) for x in v] for k, v in batched.items()},
        "decode_moe_over_dense": round(statistics.median(decode["moe"]) / statistics.median(decode["dense"]), 3),
        "batched_moe_over_dense": round(statistics.median(batched["moe"]) / statistics.median(batched["dense"]), 3),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
