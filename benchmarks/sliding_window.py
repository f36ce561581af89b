"""KV cache a long request holds on a sliding-window model, with the blocks outside the window freed
as it grows (the engine) and kept (the engine as it was before: the same model and request with the
KV cache managers' windows switched off).

    .venv/bin/python benchmarks/sliding_window.py --family mistral   # ~30 s
    .venv/bin/python benchmarks/sliding_window.py --family gemma3    # ~2 minutes

Random bf16 models small enough to run 8k tokens quickly here, blocks of 16 tokens:
- mistral: hidden 256, 4 layers, 8/2 heads of 32, every layer windowed at 4096 (Mistral 7B v0.1's);
- gemma3: Gemma 3 270M's shape of attention (18 layers, five sliding layers of window 512 to each
  full one, 4/1 heads of 256) with a narrow MLP; its layers keep K/V in six groups of three, each
  with its own block tables (a block is three layers' worth).
One request: an 8,000-token prompt (2,048 tokens a step) and 192 tokens generated, so it passes 8k
tokens. Prints the blocks held and their MiB after the prompt, at the last step, and at the most,
for both; and checks that both gave the same tokens.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PAGEDLLM_NO_PROGRESS", "1")


def make_model(path: str, family: str, window: int | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, MistralConfig

    from pagedllm.models.loader import default_model_path

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    common = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "mistral":
        config = MistralConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=window or 4096,
            **common,
        )
    else:
        config = Gemma3TextConfig(
            hidden_size=640,
            intermediate_size=256,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=window or 512,
            query_pre_attn_scalar=256,
            **common,
        )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)


def run(path: str, free_outside_window: bool, prompt_len: int, new_tokens: int) -> tuple[list[int], list[int], int]:
    """Blocks held before each step, the tokens generated, and the bytes of a block."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager

    llm = LLM(path, max_model_len=prompt_len + new_tokens + 16, kv_cache_memory="2GiB", block_size=16)
    core = llm.engine.core
    kv = core.scheduler.kv
    for manager in (kv.groups if isinstance(kv, HybridKVCacheManager) else [kv]) if not free_outside_window else ():
        manager.sliding_window = None  # the KV cache manager as it was: every block kept
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
    output = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
        use_tqdm=False,
    )[0]
    block_bytes = llm.engine.model_runner.kv_slots[0][0][0].nbytes * 2 * len(llm.engine.model_runner.kv_slots)
    llm.engine.shutdown()
    return held, output.outputs[0].token_ids, block_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=["mistral", "gemma3"], default="mistral")
    parser.add_argument("--window", type=int, default=None, help="default: 4096 (mistral), 512 (gemma3)")
    parser.add_argument("--prompt-len", type=int, default=8000)
    parser.add_argument("--new-tokens", type=int, default=192)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        make_model(path, args.family, args.window)
        results = {free: run(path, free, args.prompt_len, args.new_tokens) for free in (True, False)}
    prompt_steps = -(-args.prompt_len // 2048)
    print(f"{args.family}, {args.prompt_len} prompt + {args.new_tokens} generated tokens, blocks of 16")
    for free, (held, _, block_bytes) in results.items():
        label = "freed outside the window" if free else "all kept (before)"
        mib = lambda blocks: f"{blocks:5d} blocks {blocks * block_bytes / 2**20:7.1f} MiB"  # noqa: E731
        print(
            f"  {label:26s}: after the prompt {mib(held[prompt_steps])}, at "
            f"{args.prompt_len + args.new_tokens - 1} tokens {mib(held[-1])}, most {mib(max(held))}"
        )
    assert results[True][1] == results[False][1], "the two runs generated different tokens"
    print("  same tokens generated: yes")


if __name__ == "__main__":
    main()
