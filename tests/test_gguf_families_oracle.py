"""GGUF files of the families beyond Llama/Qwen2, held to transformers' own GGUF reader (an oracle
outside the project): a tiny random Gemma 3, Phi-3, Qwen2-MoE and Qwen3-MoE folder, written as
llama.cpp's converter writes it (tests/gguf_writer.py), read by transformers
(`from_pretrained(gguf_file=...)`, which dequantizes) and by pagedllm (`--quantization none`, fp32):
greedy tokens equal, logprobs close. The families' own test files hold the GGUF to the folder it
came from; this holds our reading of the file to someone else's."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import hf_greedy
from gguf_writer import write_gguf
from test_gemma3 import make_gemma3
from test_moe import make_moe
from test_phi3 import make_phi3


def _gemma3(path, tokenizer_dir):
    return make_gemma3(
        path,
        tokenizer_dir,
        num_hidden_layers=6,
        layer_types=None,
        query_pre_attn_scalar=256,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    )


# transformers' GGUF reader takes no expert sizes from the file (its config classes' defaults stand
# in), so the MoE models here have those sizes.
FAMILIES = {
    "gemma3": _gemma3,
    "phi3": make_phi3,
    "qwen2_moe": lambda path, tok, **kw: make_moe(
        "qwen2_moe", path, tok, dense_layers=(), moe_intermediate_size=1408, shared_expert_intermediate_size=5632, **kw
    ),
    "qwen3_moe": lambda path, tok, **kw: make_moe(
        "qwen3_moe", path, tok, dense_layers=(), moe_intermediate_size=768, **kw
    ),
}


@pytest.mark.parametrize(
    "family, qtype", [("gemma3", "F32"), ("phi3", "Q8_0"), ("qwen2_moe", "F32"), ("qwen3_moe", "Q8_0")]
)
def test_our_reading_of_the_file_equals_transformers_reading(tmp_path, tokenizer_dir, family, qtype):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    folder = FAMILIES[family](tmp_path / "hf", tokenizer_dir)
    (tmp_path / "gguf").mkdir()
    path = str(tmp_path / "gguf" / "model.gguf")  # alone in its folder: no tokenizer.json beside it
    write_gguf(folder, path, qtype, None)
    oracle = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file="model.gguf", dtype=torch.float32
    ).eval()
    llm = LLM(
        path,
        dtype="float32",
        kv_cache_memory="16MiB",
        block_size=4,
        max_model_len=64,
        quantization="none",
        tokenizer=tokenizer_dir,
    )
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    for n in (3, 17, 40):
        prompt = list(range(5 + n, 5 + 2 * n))
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        tokens, logprobs, _ = hf_greedy(oracle, prompt, params.max_tokens)
        assert output.token_ids == tokens
        ours = [entry[t].logprob for entry, t in zip(output.logprobs, tokens)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "family, qtype, overrides",
    [
        ("qwen3_moe", "Q4_K", {"ffn_down": "Q6_K"}),  # top-2 of 8 renormalized; Q4_K_M's mix
        ("qwen2_moe", "Q8_0", None),  # top-3 of 6, the full softmax kept; a shared expert
    ],
)
def test_top_k_routing_on_quantized_experts_equals_transformers(tmp_path, tokenizer_dir, family, qtype, overrides):
    """A sparse layer whose experts run quantized, given the same hidden states as transformers' own
    MoE block reading the same file (dequantized): each token's output equals transformers' within
    the int8 activations' rounding. The router is F32 in both, so both pick the same top-k experts;
    one token sent to a wrong expert, or weighted wrongly, is off by far more."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM
    from pagedllm.layers.moe import SparseMoE

    wide = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64} if qtype == "Q4_K" else {}
    folder = FAMILIES[family](tmp_path / "hf", tokenizer_dir, **wide)
    (tmp_path / "gguf").mkdir()
    path = str(tmp_path / "gguf" / "model.gguf")
    write_gguf(folder, path, qtype, None, overrides)
    oracle = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file="model.gguf", dtype=torch.float32
    ).eval()
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", max_model_len=64, tokenizer=tokenizer_dir)
    ours = llm.engine.model_runner.model.model.layers[0].mlp
    assert isinstance(ours, SparseMoE) and ours.top_k < len(ours.experts)
    assert ours.experts[0].gate_up_proj.formats == (qtype,)
    x = torch.randn(64, oracle.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = oracle.model.layers[0].mlp(x[None])
        theirs = (theirs[0] if isinstance(theirs, tuple) else theirs)[0]
        got = ours(x)
    error = (got - theirs).norm(dim=-1) / theirs.norm(dim=-1)
    print(f"{family} {qtype}: relative error per token, mean {error.mean():.4f} max {error.max():.4f}")
    assert error.max() < 0.05, error
