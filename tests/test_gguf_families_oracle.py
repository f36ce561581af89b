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
    return make_gemma3(path, tokenizer_dir, num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=256,
                       rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})


# transformers' GGUF reader takes no expert sizes from the file (its config classes' defaults stand
# in), so the MoE models here have those sizes.
FAMILIES = {"gemma3": _gemma3, "phi3": make_phi3,
            "qwen2_moe": lambda path, tok: make_moe("qwen2_moe", path, tok, dense_layers=(), moe_intermediate_size=1408,
                                                    shared_expert_intermediate_size=5632),
            "qwen3_moe": lambda path, tok: make_moe("qwen3_moe", path, tok, dense_layers=(), moe_intermediate_size=768)}


@pytest.mark.parametrize("family, qtype", [("gemma3", "F32"), ("phi3", "Q8_0"), ("qwen2_moe", "F32"),
                                           ("qwen3_moe", "Q8_0")])
def test_our_reading_of_the_file_equals_transformers_reading(tmp_path, tokenizer_dir, family, qtype):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    folder = FAMILIES[family](tmp_path / "hf", tokenizer_dir)
    (tmp_path / "gguf").mkdir()
    path = str(tmp_path / "gguf" / "model.gguf")  # alone in its folder: no tokenizer.json beside it
    write_gguf(folder, path, qtype, None)
    oracle = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file="model.gguf",
                                                  dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", block_size=4, max_model_len=64, quantization="none",
              tokenizer=tokenizer_dir)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    for n in (3, 17, 40):
        prompt = list(range(5 + n, 5 + 2 * n))
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        tokens, logprobs, _ = hf_greedy(oracle, prompt, params.max_tokens)
        assert output.token_ids == tokens
        ours = [entry[t].logprob for entry, t in zip(output.logprobs, tokens)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)
