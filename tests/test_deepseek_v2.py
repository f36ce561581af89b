"""DeepSeek-V2's multi-head latent attention and experts against transformers on tiny random models:
greedy tokens equal and logprobs within fp32 tolerance (test_model_correctness's check), with q
projected whole (V2-Lite) and through q_lora_rank (V2), greedy and group-limited routing, YaRN's
mscale; and its KV cache holding the latent rows alone, once a token."""

from __future__ import annotations

import pytest
import torch

from conftest import teacher_forced
from test_model_correctness import assert_matches_transformers
from test_more_families import make

# Head sizes apart (nope 16, rope 16, v 24; latent 32), as V2-Lite's are (128, 64, 128; 512); the
# first layer dense, then top-2 of 4 routed experts and one shared expert.
MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=24,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    num_hidden_layers=3,
    initializer_range=0.1,  # (0.02's scores are too flat for the routing and attention to matter)
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
YARN.update(mscale=0.707, mscale_all_dim=0.707, beta_fast=32.0, beta_slow=1.0)
VARIANTS = {
    "lite": {},
    "q-lora": dict(q_lora_rank=24, routed_scaling_factor=2.5),
    # (top-2 from one group of 2: where greedy would pick from two groups, the second choice differs)
    "grouped": dict(n_routed_experts=8, topk_method="group_limited_greedy", n_group=4, topk_group=1),
    "yarn": dict(rope_parameters=YARN, max_position_embeddings=256),
}


def make_deepseek(path, tokenizer_dir: str, **overrides) -> str:
    return make("DeepseekV2Config", path, tokenizer_dir, **{**MLA, **overrides})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_deepseek_v2_matches_transformers(tmp_path, tokenizer_dir, variant):
    assert_matches_transformers(make_deepseek(tmp_path, tokenizer_dir, **VARIANTS[variant]))


@pytest.mark.parametrize("variant", ["lite", "q-lora", "grouped", "yarn"])
def test_gguf_file_loads_as_its_hf_folder(tmp_path, tokenizer_dir, variant):
    """llama.cpp's deepseek2 layout (tests/gguf_writer.py) in F32: transformers' greedy tokens and
    logprobs on the folder it came from."""
    from gguf_writer import write_gguf

    folder = make_deepseek(tmp_path / "hf", tokenizer_dir, **VARIANTS[variant])
    path = str(tmp_path / "deepseek2.gguf")
    write_gguf(folder, path, "F32", tokenizer_dir)
    assert_matches_transformers(folder, path)


def test_quantized_gguf_file_computes_on_its_blocks(tmp_path, tokenizer_dir):
    """Q8_0 (rows of 32 and more; k_b's rows of 16 fall back to F16, as llama.cpp's would): the
    projections stay quantized, and each position's logprob is within the activations' int8
    rounding of the same file dequantized at load."""
    from gguf_writer import write_gguf
    from pagedllm import LLM

    folder = make_deepseek(tmp_path / "hf", tokenizer_dir, q_lora_rank=32)
    path = str(tmp_path / "deepseek2.gguf")
    write_gguf(folder, path, "Q8_0", tokenizer_dir)
    engine = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=128)
    ours = LLM(path, **engine)
    attn = ours.engine.model_runner.model.model.layers[1].self_attn
    assert attn.q_b_proj.formats == ("Q8_0",) and attn.kv_a_proj_with_mqa.formats == ("Q8_0",)
    sequences = [list(range(7, 7 + n)) for n in (4, 19, 40)]
    delta = (
        teacher_forced(ours, sequences) - teacher_forced(LLM(path, quantization="none", **engine), sequences)
    ).abs()
    assert delta.mean() < 0.04 and delta.max() < 0.3, (delta.mean(), delta.max())


def test_the_cache_holds_the_latent_rows_once(tmp_path, tokenizer_dir):
    """One tensor a layer, [blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim], read as K and V,
    and the pool's blocks counted at that size: a prompt's rows hold its normed latents."""
    from pagedllm import LLM, SamplingParams

    folder = make_deepseek(tmp_path, tokenizer_dir)
    llm = LLM(folder, dtype="float32", block_size=4, kv_cache_memory="1MiB", enable_prefix_caching=False)
    runner = llm.engine.model_runner
    k, v = runner.kv_caches[0]
    assert k is v and k.shape[1:] == (4, 1, 32 + 16)
    assert k.shape[0] == 2**20 // (3 * 4 * 48 * 4)  # layers x block x row x fp32: no V tensor counted
    prompt = list(range(5, 12))
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    attn = runner.model.model.layers[0].self_attn
    x = runner.model.model.layers[0].input_layernorm(runner.model.embed(torch.tensor(prompt)))
    latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[:, :32].contiguous())
    cached = torch.cat([k[b] for b in range(k.shape[0])])[:, 0, :32]
    found = [any(torch.allclose(row, c) for c in cached) for row in latent]
    assert all(found), found


def test_a_draft_with_latent_attention_is_refused(tmp_path, tokenizer_dir):
    from pagedllm import LLM

    folder = make_deepseek(tmp_path, tokenizer_dir)
    with pytest.raises(ValueError, match="caches latent K/V"):
        LLM(folder, speculative_config={"model": folder, "num_speculative_tokens": 2}, kv_cache_memory="1MiB")


def test_latent_blocks_read_back_from_the_store_are_bitwise_the_computed_ones(tmp_path, tokenizer_dir):
    """--kv-offload-dir: each block's one latent tensor a layer written once, read back after a
    restart, and the outputs (tokens and logprobs) exactly those computed."""
    from pagedllm import LLM, SamplingParams

    folder = make_deepseek(tmp_path / "hf", tokenizer_dir)
    args = dict(dtype="float32", kv_cache_memory="16MiB", block_size=4, kv_offload_dir=str(tmp_path / "store"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": list(range(9 + i, 50 + i))} for i in range(2)]

    def run(llm: LLM) -> list:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [
            (o.outputs[0].token_ids, [{t: e[t].logprob for t in e} for e in o.outputs[0].logprobs]) for o in outputs
        ]

    first = LLM(folder, **args)
    computed = run(first)
    first.engine.shutdown()
    again = LLM(folder, **args)
    assert run(again) == computed
    stats = again.engine.stats()
    assert stats.kv_tier_hits == 2 * 10  # each 41-token prompt's 10 full blocks before its last token
    assert stats.kv_tier_read_bytes == 2 * 10 * 3 * 4 * 48 * 4  # blocks x layers x tokens x latent row x fp32
    again.engine.shutdown()


def test_an_fp8_latent_cache_stays_close_to_the_float_one(tmp_path, tokenizer_dir):
    from pagedllm import LLM

    folder = make_deepseek(tmp_path, tokenizer_dir)
    engine = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=128)
    fp8 = LLM(folder, kv_cache_dtype="fp8_e4m3", **engine)
    assert fp8.engine.model_runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    sequences = [list(range(7, 7 + n)) for n in (4, 19, 40)]
    delta = (teacher_forced(fp8, sequences) - teacher_forced(LLM(folder, **engine), sequences)).abs()
    assert 0 < delta.mean() < 0.05 and delta.max() < 0.3, (delta.mean(), delta.max())
