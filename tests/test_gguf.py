"""GGUF loading: dequantization, llama.cpp's Q/K permutation, metadata, tokenizer and chat template."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import hf_greedy, make_model, prompts_of_mixed_lengths
from gguf_writer import write_gguf
from pagedllm import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _gguf(tmp_path, hf_dir: str, qtype: str, tokenizer_dir: str | None) -> str:
    folder = tmp_path / qtype  # alone in its folder: a tokenizer.json beside it would shadow the GGUF's
    folder.mkdir()
    path = str(folder / "model.gguf")
    write_gguf(hf_dir, path, qtype, tokenizer_dir)
    return path


def _assert_same_greedy(path: str, oracle, tokenizer_dir: str) -> None:
    """The file dequantized at load (--quantization none): exactly transformers' dequantized model.
    The files of these tests hold no tokenizer: parsing its 49k entries took transformers' reader
    most of each test's time, three times over (the tokenizer has tests of its own)."""
    llm = LLM(
        path, dtype="float32", kv_cache_memory="32MiB", block_size=4, quantization="none", tokenizer=tokenizer_dir
    )
    prompts = prompts_of_mixed_lengths(oracle.config.vocab_size, seed=4)[1:]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(oracle, prompt, PARAMS.max_tokens)[0]


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_f32_gguf_equals_the_hf_folder(tmp_path, tiny_models, tokenizer_dir, arch):
    from transformers import AutoModelForCausalLM

    path = _gguf(tmp_path, tiny_models[arch], "F32", None)
    _assert_same_greedy(
        path, AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32), tokenizer_dir
    )


@pytest.mark.parametrize(
    "arch, qtype",
    [("llama", "F32"), ("llama", "Q8_0"), ("qwen2", "Q4_0"), ("qwen2", "Q4_1"), ("llama", "F16"), ("qwen2", "BF16")],
)
def test_quantized_gguf_equals_transformers_gguf_loader(tmp_path, tiny_models, tokenizer_dir, arch, qtype):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    path = _gguf(tmp_path, tiny_models[arch], qtype, None)
    oracle = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file="model.gguf", dtype=torch.float32)
    _assert_same_greedy(path, oracle, tokenizer_dir)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quants_equal_transformers_gguf_loader(tmp_path, tokenizer_dir, qtype):
    """K-quant blocks need rows of 256 values: a wider model, with random (valid) blocks."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    hf_dir = make_model("qwen2", tmp_path / "wide", tokenizer_dir, hidden_size=256, intermediate_size=512)
    path = _gguf(tmp_path, hf_dir, qtype, None)
    oracle = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file="model.gguf", dtype=torch.float32)
    _assert_same_greedy(path, oracle, tokenizer_dir)


def test_gguf_tokenizer_and_chat_template(tmp_path, tiny_models, tokenizer_dir):
    from transformers import AutoTokenizer

    path = _gguf(tmp_path, tiny_models["qwen2"], "F32", tokenizer_dir)
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB")
    reference = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "Hello  world 42 <|im_start|>é"
    assert llm.get_tokenizer().encode(text) == reference.encode(text)
    messages = [{"role": "user", "content": "Hi!"}]
    output = llm.chat(messages, PARAMS, use_tqdm=False)[0]
    assert output.prompt_token_ids == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert 2 in llm.engine.model_config.eos_token_ids  # <|im_end|> ends generation


@pytest.mark.parametrize(
    "key", ["llama.embedding_length", "llama.block_count", "llama.attention.head_count", "llama.feed_forward_length"]
)
def test_a_file_lacking_a_needed_field_is_refused_naming_it(tmp_path, tiny_models, tokenizer_dir, key):
    path = str(tmp_path / "incomplete.gguf")
    write_gguf(tiny_models["llama"], path, "F32", tokenizer_dir, drop_keys=(key,))
    with pytest.raises(ValueError, match=f"the GGUF metadata lacks {key}, which a llama model needs"):
        LLM(path, kv_cache_memory="16MiB")
