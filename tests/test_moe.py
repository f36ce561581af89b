"""Mixture-of-experts families against transformers on tiny random models (greedy tokens equal,
logprobs close): Qwen3-MoE (renormalized top-k, a dense layer among sparse ones), Qwen2-MoE (shared
expert, top-k not renormalized), Mixtral; and the experts compute only the tokens routed to them."""

from __future__ import annotations

import json

import pytest
import torch

from test_model_correctness import assert_matches_transformers

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    initializer_range=0.2,
)


def _config(family: str, vocab: int, dense_layers: list[int], **overrides):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **{
                "vocab_size": vocab,
                "intermediate_size": 96,
                "moe_intermediate_size": 32,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "norm_topk_prob": True,
                "head_dim": 16,
                "mlp_only_layers": dense_layers,
                **COMMON,
                **overrides,
            }
        )
    if family == "qwen2_moe":
        return Qwen2MoeConfig(
            **{
                "vocab_size": vocab,
                "intermediate_size": 96,
                "moe_intermediate_size": 32,
                "num_experts": 6,
                "num_experts_per_tok": 3,
                "norm_topk_prob": False,
                "shared_expert_intermediate_size": 48,
                **COMMON,
                **overrides,
            }
        )
    return MixtralConfig(vocab_size=vocab, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **COMMON)


def make_moe(family: str, path, tokenizer_dir: str, dense_layers: tuple[int, ...] = (1,), **overrides) -> str:
    """`dense_layers`: Qwen3-MoE's mlp_only_layers (llama.cpp's qwen3moe has no dense layers);
    `overrides`: config fields."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(
        _config(family, len(tokenizer), list(dense_layers), **overrides), dtype=torch.float32
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_family_matches_transformers(tmp_path, tokenizer_dir, family):
    assert_matches_transformers(make_moe(family, tmp_path, tokenizer_dir))


def test_experts_compute_only_their_tokens(tmp_path, tokenizer_dir, monkeypatch):
    """Each expert is called once a step, on exactly the tokens routed to it (the op-by-op path)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.layers.moe import Expert, SparseMoE

    monkeypatch.setattr(SparseMoE, "bind_kernel", lambda self: "op by op for this test")
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


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_from_gguf(tmp_path, tokenizer_dir, family):
    """A tiny MoE written as llama.cpp's converter writes it (experts stacked a projection, routers
    F32; Mixtral as a llama with experts): in F32 greedy-equal to the folder it came from; in Q8_0
    its experts run quantized, each position's logprob close to the file dequantized."""
    from gguf_writer import write_gguf
    from pagedllm import LLM, SamplingParams
    from pagedllm.models.loader import describe_weights
    from test_gguf_quantized import teacher_forced

    folder = make_moe(family, tmp_path / "hf", tokenizer_dir, dense_layers=())
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 19, 40)]
    args = dict(dtype="float32", kv_cache_memory="16MiB", block_size=4, tokenizer=tokenizer_dir)

    theirs = LLM(folder, **args).generate(prompts, params, use_tqdm=False)
    write_gguf(folder, str(tmp_path / "f32.gguf"), "F32", None)  # (tokenizer=: the file's would cost seconds)
    ours = LLM(str(tmp_path / "f32.gguf"), **args).generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [e[t].logprob for e, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == pytest.approx(
            [e[t].logprob for e, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)], abs=1e-4
        )
    # Quantized: every expert routed (top-k = all), so that the int8 activations' rounding cannot
    # flip a token's choice of experts, which moves its logprob by far more than the rounding does.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["num_experts_per_tok"] = config.get("num_experts") or config["num_local_experts"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    write_gguf(folder, str(tmp_path / "q8.gguf"), "Q8_0", None)
    quantized = LLM(str(tmp_path / "q8.gguf"), **args)
    assert "gate_up_proj Q8_0" in describe_weights(quantized.engine.model_runner.model)
    dequantized = LLM(str(tmp_path / "q8.gguf"), **args, quantization="none")
    sequences = [p["prompt_token_ids"] for p in prompts]
    delta = (torch.cat(teacher_forced(quantized, sequences)) - torch.cat(teacher_forced(dequantized, sequences))).abs()
    assert delta.mean() < 0.04 and delta.max() < 0.3, (delta.mean(), delta.max())


def _native_cases():
    """Each SparseMoE option the C++ call takes: renormalized top-k, the full softmax's values and a
    shared expert, gpt-oss's clamped SwiGLU and router bias (bf16/fp32 folder, MXFP4 experts from
    GGUF), DeepSeek's group-limited routing and routed scale."""
    from test_deepseek_v2 import VARIANTS, make_deepseek
    from test_more_families import make_gpt_oss

    return {
        "qwen3_moe": lambda path, tok: make_moe("qwen3_moe", path, tok),
        "qwen2_moe": lambda path, tok: make_moe("qwen2_moe", path, tok),
        "mixtral": lambda path, tok: make_moe("mixtral", path, tok),
        "gpt-oss": make_gpt_oss,
        "deepseek-grouped": lambda path, tok: make_deepseek(path, tok, **VARIANTS["grouped"]),
        "deepseek-scaled": lambda path, tok: make_deepseek(path, tok, **VARIANTS["q-lora"]),
    }


@pytest.mark.parametrize(
    "case", ["qwen3_moe", "qwen2_moe", "mixtral", "gpt-oss", "gpt-oss-mxfp4", "deepseek-grouped", "deepseek-scaled"]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_experts_are_the_op_by_op_ones(tmp_path, tokenizer_dir, case, dtype):
    """kernels/moe.cpp's one call against SparseMoE's torch ops on the same rows: each token's
    experts the same and their weights within fp32's rounding; where the experts match, the output
    within fp32 rounding (fp32) and bit for bit (bf16: each step rounds where the torch ops do).
    bf16 logits can tie, and topk breaks ties its own way: those tokens must be ties, and few."""
    from pagedllm import LLM
    from pagedllm.layers.moe import SparseMoE

    path = _native_cases()[case.removesuffix("-mxfp4")](tmp_path / "hf", tokenizer_dir)
    if case.endswith("-mxfp4"):
        from gguf_writer import write_gguf

        write_gguf(path, str(tmp_path / "m.gguf"), "Q8_0", tokenizer_dir, {"_exps.": "MXFP4"})
        path = str(tmp_path / "m.gguf")
    llm = LLM(path, dtype=dtype, kv_cache_memory="16MiB", max_model_len=128)
    blocks = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(block.native is not None for block in blocks)
    g = torch.Generator().manual_seed(0)
    for block in blocks:
        x = torch.randn(40, block.gate.in_features, generator=g).to(getattr(torch, dtype))
        for rows in (x[:1], x):  # one token, and a step's worth
            weights, experts = block.route(rows)
            native_weights, native_experts = block.native.route(rows)
            same = (experts.sort(dim=-1).values == native_experts.sort(dim=-1).values).all(dim=-1)
            ours, reference = block.native(rows), block._routed(rows)
            if dtype == "float32":
                assert same.all()
                assert torch.equal(experts, native_experts)
                torch.testing.assert_close(native_weights, weights, rtol=0, atol=1e-6)
                torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
                continue
            assert torch.equal(ours[same], reference[same])
            assert len(rows) == 1 or same.float().mean() >= 0.9
            if same.all():
                continue
            logits = block.gate(rows[~same]).float()  # the tokens apart: a tie at the k-th expert's logit
            kth = logits.topk(block.top_k, dim=-1).values[:, -1:]
            assert ((logits == kth).sum(dim=-1) >= 2).all()
