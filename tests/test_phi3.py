"""Phi-3 / Phi-4-mini against transformers on tiny random models: fused q/k/v and gate/up in the
checkpoint, a partial rotary (Phi-4-mini's 3/4), LongRoPE."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy
from test_model_correctness import assert_matches_transformers


def make_phi3(path, tokenizer_dir: str, **overrides) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Phi3Config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Phi3Config(
        **{
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 2,
            "initializer_range": 0.2,
            **overrides,
        }
    )
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("rotary", [1.0, 0.75, 0.5], ids=["full-rotary", "phi4-mini-rotary", "half-rotary"])
def test_phi3_matches_transformers(tmp_path, tokenizer_dir, rotary):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary}
    assert_matches_transformers(make_phi3(tmp_path, tokenizer_dir, rope_parameters=rope))


def test_longrope_takes_its_short_factors_within_the_original_context(tmp_path, tokenizer_dir):
    """max_model_len within original_max_position_embeddings: the short factors, as transformers
    uses for sequences that short (past it, both use the long ones)."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    half = 16 * 3 // 4 // 2  # pairs of rotated dims: head_dim 16, 3/4 rotated
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.3 * i for i in range(half)],
        "long_factor": [2.0 + i for i in range(half)],
    }
    path = make_phi3(tmp_path, tokenizer_dir, rope_parameters=rope)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", block_size=4, max_model_len=64)
    prompts = [list(range(10, 10 + n)) for n in (5, 20, 40)]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, 12)[0]


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_phi3_gguf_loads_as_its_hf_folder(tmp_path, tokenizer_dir, qtype):
    """Written as llama.cpp writes Phi-3 (q/k/v and gate/up fused, the rotated dims and LongRoPE's
    factors in the file). F32: greedy tokens equal to the folder's. Q8_0, computed on quantized (q
    and k rows reordered as raw blocks): each position's logprob within the activations' int8
    rounding of the same file dequantized at load."""
    from gguf_writer import write_gguf
    from pagedllm import LLM, SamplingParams
    from test_gguf_quantized import teacher_forced

    half = 16 * 3 // 4 // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.3 * i for i in range(half)],
        "long_factor": [2.0 + i for i in range(half)],
    }
    folder = make_phi3(tmp_path / "hf", tokenizer_dir, rope_parameters=rope)
    path = str(tmp_path / "phi3.gguf")
    write_gguf(folder, path, qtype, tokenizer_dir)
    engine = dict(dtype="float32", kv_cache_memory="16MiB", block_size=4, max_model_len=64)
    ours = LLM(path, **engine)
    sequences = [list(range(7, 7 + n)) for n in (4, 19, 40)]
    if qtype == "F32":
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        prompts = [{"prompt_token_ids": s} for s in sequences]
        theirs = LLM(folder, **engine).generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in ours.generate(prompts, params, use_tqdm=False)] == [
            o.outputs[0].token_ids for o in theirs
        ]
        return
    assert ours.engine.model_runner.model.model.layers[0].self_attn.qkv_proj.formats == ("Q8_0",)
    dequantized = LLM(path, quantization="none", **engine)
    delta = (torch.cat(teacher_forced(ours, sequences)) - torch.cat(teacher_forced(dequantized, sequences))).abs()
    assert delta.mean() < 0.04 and delta.max() < 0.3, (delta.mean(), delta.max())
