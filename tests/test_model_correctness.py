"""Greedy tokens equal transformers' on the same weights; logprobs agree within fp32 tolerance."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, greedy_without_kernels, hf_greedy, prompts_of_mixed_lengths
from pagedllm import LLM, SamplingParams

MAX_TOKENS = 12


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logprobs_match_transformers(arch, tiny_models):
    assert_matches_transformers(tiny_models[arch])


def assert_matches_transformers(path: str, ours: str | None = None) -> None:
    """Greedy tokens equal, token and prompt logprobs within fp32 tolerance, on prompts of mixed
    lengths: transformers on the folder `path`, pagedllm on `ours` (a file made of it) or the same."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(ours or path, dtype="float32", block_size=4, kv_cache_memory="64MiB")
    prompts = prompts_of_mixed_lengths(hf.config.vocab_size, seed=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs, prompt_logprobs = hf_greedy(hf, prompt, MAX_TOKENS)
        sample = output.outputs[0]
        assert sample.token_ids == tokens
        ours = [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)
        assert all(entry[t].rank == 1 for entry, t in zip(sample.logprobs, sample.token_ids))
        assert output.prompt_logprobs[0] is None
        ours_prompt = [entry[t].logprob for entry, t in zip(output.prompt_logprobs[1:], prompt[1:])]
        torch.testing.assert_close(torch.tensor(ours_prompt), torch.tensor(prompt_logprobs), atol=1e-4, rtol=1e-4)
        assert sample.cumulative_logprob == pytest.approx(sum(ours))
        assert sample.finish_reason == "length"


def test_default_model_matches_transformers_gguf_loader(default_hf_model):
    """The real SmolLM2 weights dequantized at load (--quantization none): our GGUF dequant + Q/K
    un-permute vs transformers' own GGUF loader."""
    hf = default_hf_model
    llm = LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=2048, quantization="none")
    tokenizer = llm.get_tokenizer()
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away, there lived a dragon who " * 4,
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs, _ = hf_greedy(hf, prompt, 16)
        assert output.outputs[0].token_ids == tokens
        ours = [entry[t].logprob for entry, t in zip(output.outputs[0].logprobs, tokens)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-3, rtol=1e-3)
    assert outputs[0].outputs[0].text.startswith(" Paris")


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True])
def test_pure_torch_path_gives_the_same_greedy_tokens(tiny_models, compile):
    """Without the C++ kernels (as on a GPU, or with no compiler) every layer takes its torch
    reference: the same greedy tokens must come out, and with --compile too, where those torch
    paths run compiled."""
    path = tiny_models["qwen3"]
    prompts = prompts_of_mixed_lengths(49152, seed=6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", block_size=4)
    ours = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    tokens, graphs = greedy_without_kernels(
        dict(model=path, dtype="float32", kv_cache_memory="16MiB", block_size=4, compile=compile), prompts, 6
    )
    assert tokens == ours
    # Compiled: norms, SiLU and rotary each became graphs (and decode's one-token shapes their own).
    assert graphs >= 4 if compile else graphs == 0
