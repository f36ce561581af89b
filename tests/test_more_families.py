"""Granite, OLMo 2 and SmolLM3 against transformers on tiny random models: greedy tokens equal and
logprobs within fp32 tolerance (test_model_correctness's check), on the op-by-op path and, where the
family runs in it, the C++ decoder stack."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, teacher_forced
from test_model_correctness import assert_matches_transformers


def make(config_class: str, path, tokenizer_dir: str, seed: int = 0, **overrides) -> str:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = getattr(transformers, config_class)(**{"vocab_size": len(tokenizer), **TINY, **overrides})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# Granite 3's multipliers, of the sizes its 2B model's config gives them
GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.03, logits_scaling=8.0)
EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)  # Granite-MoE's: top-2 of 4


@pytest.mark.parametrize("tied", [True, False])
def test_granite_matches_transformers(tmp_path, tokenizer_dir, tied):
    assert_matches_transformers(make("GraniteConfig", tmp_path, tokenizer_dir, tie_word_embeddings=tied, **GRANITE))


def test_granite_moe_matches_transformers(tmp_path, tokenizer_dir):
    """Top-2 of 4 experts on every layer, Granite's multipliers."""
    assert_matches_transformers(make("GraniteMoeConfig", tmp_path, tokenizer_dir, **GRANITE, **EXPERTS))


def make_gpt_oss(path, tokenizer_dir: str) -> str:
    """Top-2 of 4 experts (clamped SwiGLU, biases), attention sinks, a window of 8 on every other
    layer, YaRN; sinks and biases drawn away from 0, so that they matter."""
    from safetensors.torch import load_file, save_file

    folder = make("GptOssConfig", path, tokenizer_dir, head_dim=16, sliding_window=8, **EXPERTS)
    weights = load_file(f"{folder}/model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith(("sinks", "_bias", "router.bias"))]:
        weights[name] = torch.randn(weights[name].shape, generator=g)
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    return folder


def test_gpt_oss_matches_transformers(tmp_path, tokenizer_dir):
    assert_matches_transformers(make_gpt_oss(tmp_path, tokenizer_dir))


def test_olmo2_matches_transformers(tmp_path, tokenizer_dir):
    assert_matches_transformers(make("Olmo2Config", tmp_path, tokenizer_dir))


@pytest.mark.parametrize("interval", [2, 4])
def test_smollm3_matches_transformers(tmp_path, tokenizer_dir, interval):
    """Layers without rotary (NoPE) every `interval` layers: 4 layers, so at least one of each kind."""
    folder = make("SmolLM3Config", tmp_path, tokenizer_dir, num_hidden_layers=4, no_rope_layer_interval=interval)
    assert_matches_transformers(folder)


# Each family as llama.cpp's converter writes it (tests/gguf_writer.py): Granite a llama layout (Q/K
# interleaved) with its multipliers as metadata; SmolLM3 a llama layout with no key for its NoPE
# layers (llama.cpp fixes them at every fourth, its config's default); OLMo 2 with transformers' Q/K
# rows and its post-norms and full-width q/k norms as tensors of their own.
GGUF_FAMILIES = {
    "granite": lambda path, tok: make("GraniteConfig", path, tok, **GRANITE),
    "granite-moe": lambda path, tok: make("GraniteMoeConfig", path, tok, **GRANITE, **EXPERTS),
    "smollm3": lambda path, tok: make("SmolLM3Config", path, tok, num_hidden_layers=4),
    "olmo2": lambda path, tok: make("Olmo2Config", path, tok),
    "gpt-oss": make_gpt_oss,  # its quantized file's experts in MXFP4, as llama.cpp keeps gpt-oss's
}


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_file_loads_as_its_hf_folder(tmp_path, tokenizer_dir, family, qtype):
    """F32: transformers' greedy tokens and logprobs on the folder the file came from. Q8_0, computed
    on quantized: each position's logprob within the activations' int8 rounding of the same file
    dequantized at load."""
    from gguf_writer import write_gguf
    from pagedllm import LLM

    folder = GGUF_FAMILIES[family](tmp_path / "hf", tokenizer_dir)
    path = str(tmp_path / f"{family}.gguf")
    experts = {"_exps.": "MXFP4"} if family == "gpt-oss" and qtype != "F32" else None
    write_gguf(folder, path, qtype, tokenizer_dir, experts)
    if qtype == "F32":
        assert_matches_transformers(folder, path)
        return
    engine = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=128)
    ours = LLM(path, **engine)
    layer = ours.engine.model_runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.formats == ("Q8_0",)
    if experts:
        assert layer.mlp.experts[0].gate_up_proj.formats == ("MXFP4",)
    sequences = [list(range(7, 7 + n)) for n in (4, 19, 40)]
    delta = (
        teacher_forced(ours, sequences) - teacher_forced(LLM(path, quantization="none", **engine), sequences)
    ).abs()
    assert delta.mean() < 0.04 and delta.max() < 0.3, (delta.mean(), delta.max())


@pytest.mark.e2e
@pytest.mark.parametrize("family", ["granite", "smollm3"])
def test_two_ranks_give_one_rank_greedy_tokens(tmp_path, tokenizer_dir, family):
    from pagedllm import LLM, SamplingParams

    folder = GGUF_FAMILIES[family](tmp_path, tokenizer_dir)
    args = dict(dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]

    def greedy(llm: LLM) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    split = LLM(folder, tensor_parallel_size=2, **args)
    assert greedy(split) == greedy(LLM(folder, **args))
    split.engine.shutdown()


def test_olmo2_refuses_tensor_parallelism_at_start_up(tmp_path, tokenizer_dir):
    from pagedllm import LLM

    with pytest.raises(ValueError, match="Olmo2ForCausalLM does not split over tensor-parallel ranks"):
        LLM(make("Olmo2Config", tmp_path, tokenizer_dir), tensor_parallel_size=2)
