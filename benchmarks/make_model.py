"""Write a random-weight Hugging Face Llama folder of a realistic shape, loadable by every engine.

    python benchmarks/make_model.py --out /tmp/llama-250m
    python benchmarks/make_model.py --arch qwen3 --out /tmp/qwen3-250m   # the same shape, per-head q/k norms
    python benchmarks/make_model.py --out /tmp/llama-250m-32k --max-position-embeddings 32768 --rope-theta 1e6
    python benchmarks/make_model.py --arch gpt-oss --num-layers 8 --intermediate-size 1024 --out /tmp/gpt-oss-moe

Default shape: hidden 1024, 16 layers, 16 heads, 4 KV heads, intermediate 2816, vocab 32000,
bf16 (about 250M parameters). gpt-oss: --num-experts experts of --intermediate-size, top
--experts-per-token, heads of 64, a window of 128 on every other layer (the 8-layer shape above:
about 490M parameters, 155M active a token). The tokenizer is the default model's (SmolLM2's, read from its
GGUF), cut to the vocabulary (its BPE merges past it dropped), so that any text a client sends
encodes to ids the model has; random weights make the text meaningless, not the timing.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def cut_tokenizer(path: str, vocab_size: int) -> None:
    """Drop the BPE tokens with ids from vocab_size on, and the merges that would make them."""
    with open(path) as f:
        spec = json.load(f)
    model = spec["model"]
    if len(model["vocab"]) <= vocab_size:
        return
    model["vocab"] = {token: i for token, i in model["vocab"].items() if i < vocab_size}
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
    model["merges"] = [m for m, (a, b) in zip(model["merges"], pairs) if a + b in model["vocab"]]
    assert all(t["id"] < vocab_size for t in spec["added_tokens"]), "special tokens past the vocabulary"
    with open(path, "w") as f:
        json.dump(spec, f, ensure_ascii=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=2816)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--max-position-embeddings", type=int, default=4096)
    parser.add_argument("--rope-theta", type=float, default=10000.0, help="the rotary base (1e6 for long contexts)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=["llama", "qwen3", "gpt-oss"], default="llama")
    parser.add_argument("--num-experts", type=int, default=16, help="gpt-oss only")
    parser.add_argument("--experts-per-token", type=int, default=4, help="gpt-oss only")
    args = parser.parse_args()

    import torch
    from transformers import (
        AutoTokenizer,
        GptOssConfig,
        GptOssForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from pagedllm.models.loader import default_model_path

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "gpt-oss": (GptOssConfig, GptOssForCausalLM),
    }
    config_class, model_class = classes[args.arch]
    if args.arch == "gpt-oss":  # its own rotary (YaRN, transformers' defaults): --rope-theta not used
        arch_fields = dict(
            num_local_experts=args.num_experts,
            num_experts_per_tok=args.experts_per_token,
            head_dim=64,
            sliding_window=128,
        )
    else:
        arch_fields = dict(rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta})
    config = config_class(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        **arch_fields,
    )
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    model = model_class(config).to(dtype)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    cut_tokenizer(os.path.join(args.out, "tokenizer.json"), args.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {params / 1e6:.0f}M parameters, {args.dtype}")


if __name__ == "__main__":
    main()
