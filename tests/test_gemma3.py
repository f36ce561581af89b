"""Gemma 3 (text) against transformers on tiny random models: greedy tokens equal, logprobs close,
with sliding-window and full layers interleaved (each with its own rotary base), norms whose
weights are offsets from 1, and the final logits soft-capped or not."""

from __future__ import annotations

import pytest
import torch

from test_model_correctness import assert_matches_transformers


def make_gemma3(path, tokenizer_dir: str, **overrides) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Gemma3TextConfig(
        **{
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "max_position_embeddings": 512,
            "sliding_window": 8,  # smaller than the prompts: it matters
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            },
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 2,
            "initializer_range": 0.2,
            **overrides,
        }
    )
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF starts Gemma's norm weights at 0 (a scale of 1): make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcapped"])
def test_gemma3_matches_transformers(tmp_path, tokenizer_dir, softcap):
    path = make_gemma3(tmp_path, tokenizer_dir, final_logit_softcapping=softcap)
    assert type(__import__("transformers").AutoConfig.from_pretrained(path)).__name__ == "Gemma3TextConfig"
    assert_matches_transformers(path)


def test_gemma3_gguf_loads_as_its_hf_folder(tmp_path, tokenizer_dir):
    """A GGUF file says neither the pattern of sliding and full layers, nor the local rotary base,
    nor query_pre_attn_scalar: the config class's defaults stand in (llama.cpp's too). A model made
    with those defaults, written as llama.cpp's converter writes it (norms stored plus 1), greedy-
    equal to the folder it came from."""
    from gguf_writer import write_gguf
    from pagedllm import LLM, SamplingParams

    folder = make_gemma3(
        tmp_path / "hf",
        tokenizer_dir,
        num_hidden_layers=6,
        layer_types=None,
        query_pre_attn_scalar=256,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    )
    path = str(tmp_path / "gemma3.gguf")
    write_gguf(folder, path, "F32", tokenizer_dir)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 11, 30)]
    ours = LLM(path, dtype="float32", kv_cache_memory="32MiB", block_size=4).generate(prompts, params, use_tqdm=False)
    theirs = LLM(folder, dtype="float32", kv_cache_memory="32MiB", block_size=4).generate(
        prompts, params, use_tqdm=False
    )
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(
            torch.tensor([e[t].logprob for e, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]),
            torch.tensor([e[t].logprob for e, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]),
            atol=1e-4,
            rtol=1e-4,
        )


def make_gemma2(path, tokenizer_dir: str, **overrides) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma2Config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Gemma2Config(
        **{
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "max_position_embeddings": 512,
            "sliding_window": 8,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 2,
            "initializer_range": 0.2,
            **overrides,
        }
    )
    torch.manual_seed(13)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_gemma2_matches_transformers(tmp_path, tokenizer_dir):
    """Gemma 2 on the same code: no q/k norms, one rotary base, attention and final logits soft-capped."""
    assert_matches_transformers(make_gemma2(tmp_path, tokenizer_dir))


def test_gemma2_gguf_loads_as_its_hf_folder(tmp_path, tokenizer_dir):
    """A Gemma 2 GGUF file carries its soft-caps and window; its queries are scaled by the head
    size (as llama.cpp scales them): a model made so, greedy-equal to the folder it came from."""
    from gguf_writer import write_gguf
    from pagedllm import LLM, SamplingParams

    folder = make_gemma2(tmp_path / "hf", tokenizer_dir, query_pre_attn_scalar=16)
    path = str(tmp_path / "gemma2.gguf")
    write_gguf(folder, path, "F32", tokenizer_dir)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 11, 30)]
    ours = LLM(path, dtype="float32", kv_cache_memory="32MiB", block_size=4)
    config = ours.engine.model_config.hf_config
    assert (config.attn_logit_softcapping, config.final_logit_softcapping, config.sliding_window) == (2.0, 5.0, 8)
    ours = ours.generate(prompts, params, use_tqdm=False)
    theirs = LLM(folder, dtype="float32", kv_cache_memory="32MiB", block_size=4).generate(
        prompts, params, use_tqdm=False
    )
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [e[t].logprob for e, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == pytest.approx(
            [e[t].logprob for e, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)], abs=1e-4
        )
