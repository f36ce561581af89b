"""Mixture-of-experts families against transformers on tiny random models (greedy tokens equal,
logprobs close): Qwen3-MoE (renormalized top-k, a dense layer among sparse ones), Qwen2-MoE (shared
expert, top-k not renormalized), Mixtral; and the experts compute only the tokens routed to them."""
from __future__ import annotations

import pytest
import torch

from test_model_correctness import assert_matches_transformers

COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.2)


def _config(family: str, vocab: int):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if family == "qwen3_moe":
        return Qwen3MoeConfig(vocab_size=vocab, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, mlp_only_layers=[1], **COMMON)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(vocab_size=vocab, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                              num_experts_per_tok=3, norm_topk_prob=False, shared_expert_intermediate_size=48,
                              **COMMON)
    return MixtralConfig(vocab_size=vocab, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **COMMON)


def make_moe(family: str, path, tokenizer_dir: str) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(_config(family, len(tokenizer)), dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_family_matches_transformers(tmp_path, tokenizer_dir, family):
    assert_matches_transformers(make_moe(family, tmp_path, tokenizer_dir))


def test_experts_compute_only_their_tokens(tmp_path, tokenizer_dir, monkeypatch):
    """Each expert is called once a step, on exactly the tokens routed to it."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.layers.moe import Expert, SparseMoE

    llm = LLM(make_moe("qwen3_moe", tmp_path, tokenizer_dir), dtype="float32", kv_cache_memory="16MiB")
    calls: list[int] = []
    routed: list[int] = []
    forward, route = Expert.forward, SparseMoE.route

    def counting_forward(self, x):
        calls.append(x.shape[0])
        return forward(self, x)

    def counting_route(self, x):
        weights, experts = route(self, x)
        routed.append(experts.numel())
        return weights, experts

    monkeypatch.setattr(Expert, "forward", counting_forward)
    monkeypatch.setattr(SparseMoE, "route", counting_route)
    llm.generate([{"prompt_token_ids": list(range(5, 45))}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert sum(calls) == sum(routed) == 2 * 40 * 2  # two sparse layers, 40 tokens, top-2
    assert len(calls) <= 2 * 8 and max(calls) < 40  # at most one call per expert per layer
