"""KV blocks a long request holds on a sliding-window model, with the blocks outside the window
freed as it grows (the engine) and kept (the engine as it was before: the same model and request
with the KV cache manager's window switched off).

    .venv/bin/python benchmarks/sliding_window.py            # ~2 minutes

A random Mistral-shaped model small enough to run 8k tokens quickly here (hidden 256, 4 layers,
8/2 heads of 32, window 4096 as Mistral 7B v0.1 has it; bf16), block size 16. One request: an
8,000-token prompt (chunked, 2,048 tokens a step) and 192 tokens generated, so the request passes
8k tokens. Prints the blocks held after the prompt and at the end, and the greatest number held at
any step, for both; and checks that both gave the same tokens.
"""
from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PAGEDLLM_NO_PROGRESS", "1")


def make_model(path: str, window: int) -> None:
    import torch
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    from pagedllm.models.loader import default_model_path

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=16384,
                           sliding_window=window, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    MistralForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)


def run(path: str, free_outside_window: bool, prompt_len: int, new_tokens: int) -> tuple[list[int], list[int]]:
    """Blocks held after each step, and the tokens generated."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(path, max_model_len=prompt_len + new_tokens + 16, kv_cache_memory="1GiB", block_size=16)
    core = llm.engine.engine_core
    if not free_outside_window:
        core.scheduler.kv.sliding_window = None  # the KV cache manager as it was: every block kept
    held: list[int] = []
    step = core.step

    def counting_step():
        outputs = step()
        stats = core.scheduler.stats()
        if stats.num_running:  # (the last step finishes the request and frees everything)
            held.append(stats.kv_blocks_total - stats.kv_blocks_free)
        return outputs

    core.step = counting_step
    prompt = [100 + (i * 7919) % 20000 for i in range(prompt_len)]
    output = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=new_tokens,
                                                                         ignore_eos=True), use_tqdm=False)[0]
    llm.engine.shutdown()
    return held, output.outputs[0].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=8000)
    parser.add_argument("--new-tokens", type=int, default=192)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        make_model(path, args.window)
        results = {free: run(path, free, args.prompt_len, args.new_tokens) for free in (True, False)}
    prompt_steps = -(-args.prompt_len // 2048)
    print(f"window {args.window}, {args.prompt_len} prompt + {args.new_tokens} generated tokens, blocks of 16")
    for free, (held, _) in results.items():
        label = "freed outside the window" if free else "all kept (before)"
        print(f"  {label:26s}: after the prompt {held[prompt_steps - 1]:4d} blocks, at "
              f"{args.prompt_len + args.new_tokens - 1} tokens {held[-1]:4d}, most at any step {max(held):4d}")
    assert results[True][1] == results[False][1], "the two runs generated different tokens"
    print("  same tokens generated: yes")


if __name__ == "__main__":
    main()
