"""Bad input gets a clear error and leaves the engine serving."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pagedllm import LLM, SamplingParams

OK = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", max_model_len=64)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("word " * 80, "max_model_len"),
        ([1] * 64, "max_model_len"),
        ([], "empty"),
        ([5, 10**9], "out of vocabulary"),
        ([[1, 2]], "string or a list of token ids"),
        (3.5, "string or a list of token ids"),
    ],
)
def test_bad_prompts_raise_and_engine_keeps_serving(llm, prompt, message):
    reference = llm.generate(["hello"], OK, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=message):
        llm.generate(["hello", prompt], OK, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert llm.generate(["hello"], OK, use_tqdm=False)[0].outputs[0].token_ids == reference


def test_bad_params_for_this_model(llm):
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate(["hi"], SamplingParams(logit_bias={10**9: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["hi"], [OK, OK], use_tqdm=False)
    with pytest.raises(TypeError, match="unknown LLM arguments"):
        LLM(None, not_a_flag=1)
    assert llm.generate(["hi"], OK, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_bad_model_paths(tmp_path, llama_dir):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))
    unknown = tmp_path / "gpt2ish"
    shutil.copytree(llama_dir, unknown)
    config = json.loads((unknown / "config.json").read_text())
    config["architectures"], config["model_type"] = ["FancyNewForCausalLM"], "llama"
    (unknown / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture"):
        LLM(str(unknown))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(llama_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ValueError, match="cannot read weights"):
        LLM(str(corrupt), kv_cache_memory="32MiB")
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="GGUF"):
        LLM(str(bad_gguf))


def test_kv_budget_too_small_for_context(llama_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llama_dir, kv_cache_memory=1024, max_model_len=64)
    with pytest.raises(ValueError, match="memory size"):
        LLM(llama_dir, kv_cache_memory="lots")
