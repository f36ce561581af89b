"""A request's greedy tokens and their logprobs are bit for bit its run alone, whatever else runs
(issue 44): in batches of random others, with small prefill chunks, with the prefix cache cold or
warm, after preemption and recompute, with n-gram speculation; seeded samples likewise. bf16 and
each quantized format (bf16 activations), and fp32, on tiny models through the C++ kernels; a
Qwen3 with one KV head (its per-head k norms of a step's tokens) in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_model
from gguf_writer import write_gguf
from hf_checkpoints import awq, gptq, quantize_folder
from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_ops
from test_more_families import make

# DeepSeek-V2's heads at WIDE's 64 dims: latent 64 and rotary key 64; top-2 of 4 experts beside one shared
MLA = dict(num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64)
MLA.update(v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1)
MLA.update(first_k_dense_replace=1)
# Gemma 2's soft-caps, of its 2B model's sizes; full attention on both layers (as gpt-oss's below)
GEMMA2 = dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, layer_types=["full_attention"] * 2)
GEMMA2.update(query_pre_attn_scalar=64)

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the kernels under test are the C++ ones")

# Head size 64 and groups of 2: the AVX512-BF16 attention walks; rows of 256 for the K types.
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
WIDE.update(initializer_range=0.05, max_position_embeddings=256)
# (checkpoint, dtype): an HF folder ("hf") or a GGUF file of that type; llama ties its head.
# "qwen3": an HF folder of a Qwen3 (per-head q/k norms) with one KV head.
CASES = [
    ("hf", "bfloat16"),
    ("hf", "float32"),
    ("Q8_0", "bfloat16"),
    ("Q4_0", "bfloat16"),
    ("Q4_1", "bfloat16"),
    ("Q5_0", "bfloat16"),
    ("Q5_1", "bfloat16"),
    ("Q4_K", "bfloat16"),
    ("Q5_K", "bfloat16"),
    ("Q2_K", "bfloat16"),
    ("IQ4_NL", "bfloat16"),
    ("Q4_1", "float32"),
    ("qwen3", "bfloat16"),
    ("qwen3", "float32"),
    ("awq", "bfloat16"),  # Hugging Face quantized folders: AWQ as Q4_1 records, GPTQ act-order's permuted inputs
    ("gptq-act-order", "bfloat16"),
    ("gpt-oss", "bfloat16"),  # the C++ stack with attention sinks and kernels/moe.cpp's experts
    ("olmo2", "bfloat16"),  # families op by op: norms after each sublayer
    ("deepseek-v2", "bfloat16"),  # latent attention (one cached row a token, read as K and V), shared experts
    ("gemma2", "bfloat16"),  # soft-capped attention scores (the torch path) and final logits
]
# The other families' folders (tests/test_more_families.py's configs), of WIDE's shapes, and
# their K/V heads of 64 (DeepSeek's latent row, 64 + 64 wide and one a token, counts as one head's K and V)
FAMILIES = {
    # (full attention on both layers, so that the busy engine's pool, sized for that, preempts)
    "gpt-oss": (
        "GptOssConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2),
        2,
    ),
    "olmo2": ("Olmo2Config", {}, 2),
    "deepseek-v2": ("DeepseekV2Config", {**MLA, "num_hidden_layers": 2, "initializer_range": 0.05}, 1),
    "gemma2": ("Gemma2Config", GEMMA2, 2),
}
# The quantized folders' packers (tests/hf_checkpoints.py) and configs
FOLDERS = {
    "awq": (lambda w: awq(w), {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}),
    "gptq-act-order": (
        lambda w: gptq(w, 4, True, True),
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
    ),
}
# Files of mixed types, as llama.cpp's Q4_K_M mixes Q4_K and Q6_K (the newer types two files among them)
PARTS = {
    "Q4_K": {"attn_v": "Q6_K", "ffn_down": "Q6_K"},
    "Q2_K": {"attn_v": "Q3_K", "ffn_down": "IQ4_XS"},
    "IQ4_NL": {"attn_v": "MXFP4", "ffn_down": "IQ3_S"},
}
MAX_TOKENS = 6
MAX_MODEL_LEN = 160
EXAMPLES = 5  # the default tier's; the slow tier runs 4x as many


class Case:
    """The engines of one checkpoint: `alone` runs one request at a time with no prefix cache (the
    reference); `busy` has small prefill chunks and a KV pool that forces preemption; `spec` drafts
    by n-gram lookup."""

    def __init__(self, path: str, tokenizer: str, dtype: str, kv_heads: int = 2) -> None:
        common = dict(tokenizer=tokenizer, dtype=dtype, max_model_len=MAX_MODEL_LEN, seed=0)
        kv_bytes = 2 * kv_heads * 64 * 2 * (4 if dtype == "float32" else 2)  # layers x KV heads x dims x (K, V)
        self.alone = LLM(path, enable_prefix_caching=False, kv_cache_memory="16MiB", **common)
        self.busy = LLM(path, max_num_batched_tokens=19, kv_cache_memory=kv_bytes * 2 * MAX_MODEL_LEN, **common)
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
        self.spec = LLM(path, speculative_config=spec, kv_cache_memory="16MiB", **common)
        self.references: dict[tuple, tuple] = {}

    def reference(self, prompt: list[int], params: SamplingParams) -> tuple:
        key = (tuple(prompt), params.temperature, params.seed, params.max_tokens)
        if key not in self.references:
            self.references[key] = run(self.alone, [prompt], [params])[0]
        return self.references[key]


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[list[int], list[float]]]:
    """Each request's tokens and the logprobs of those tokens."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for o in outputs:
        c = o.outputs[0]
        results.append((list(c.token_ids), [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]))
    return results


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory, tokenizer_dir) -> str:
    return make_model("llama", tmp_path_factory.mktemp("wide-llama"), tokenizer_dir, num_hidden_layers=2, **WIDE)


@pytest.fixture(scope="module", params=CASES, ids=[f"{c}-{d}" for c, d in CASES])
def case(request, tmp_path_factory, wide_llama, tokenizer_dir) -> Case:
    checkpoint, dtype = request.param
    path = wide_llama
    if checkpoint == "qwen3":
        one_kv_head = {**WIDE, "num_key_value_heads": 1}
        path = make_model("qwen3", tmp_path_factory.mktemp("qwen3"), tokenizer_dir, num_hidden_layers=2, **one_kv_head)
        return Case(path, tokenizer_dir, dtype, kv_heads=1)
    if checkpoint in FAMILIES:
        config_class, overrides, kv_heads = FAMILIES[checkpoint]
        path = make(config_class, tmp_path_factory.mktemp(checkpoint), tokenizer_dir, **{**WIDE, **overrides})
        return Case(path, tokenizer_dir, dtype, kv_heads)
    if checkpoint in FOLDERS:
        root = tmp_path_factory.mktemp(checkpoint)
        quantize_folder(wide_llama, str(root / "q"), str(root / "d"), *FOLDERS[checkpoint])
        return Case(str(root / "q"), tokenizer_dir, dtype)
    if checkpoint != "hf":
        path = str(tmp_path_factory.mktemp(checkpoint) / "model.gguf")
        write_gguf(wide_llama, path, checkpoint, None, PARTS.get(checkpoint))
    return Case(path, tokenizer_dir, dtype)


@st.composite
def workloads(draw, vocab: int = 49152):
    """Prompts that share some of three prefixes, each with its own sampling parameters."""
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(3, vocab, (80,), generator=g).tolist() for _ in range(3)]
    count = draw(st.integers(1, 12))
    prompts, params = [], []
    for _ in range(count):
        prefix = prefixes[draw(st.integers(0, 2))][: draw(st.integers(0, 80))]
        suffix = torch.randint(3, vocab, (draw(st.integers(1, 40)),), generator=g).tolist()
        repeat = draw(st.integers(0, 2))  # repeated pieces give the n-gram proposer drafts
        prompts.append((prefix + suffix * (1 + repeat))[: MAX_MODEL_LEN - MAX_TOKENS])
        sampled = draw(st.booleans()) and draw(st.booleans())  # a quarter seeded samples
        params.append(
            SamplingParams(
                temperature=0.8 if sampled else 0.0,
                seed=draw(st.integers(0, 1000)) if sampled else None,
                max_tokens=draw(st.integers(1, MAX_TOKENS)),
                ignore_eos=True,
                logprobs=0,
            )
        )
    engine = draw(st.sampled_from(["busy", "spec"]))
    return prompts, params, engine


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_every_request_as_if_alone(case, workload):
    _check_as_if_alone(case, workload)


@pytest.mark.slow
@settings(max_examples=4 * EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_every_request_as_if_alone_longer_run(case, workload):
    """The slow tier's larger run of the property above."""
    _check_as_if_alone(case, workload)


def _check_as_if_alone(case: Case, workload: tuple) -> None:
    prompts, params, engine = workload
    llm = getattr(case, engine)
    got = run(llm, prompts, params)
    for prompt, p, output in zip(prompts, params, got):
        assert output == case.reference(prompt, p), (engine, len(prompt), p)
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_preemption_happens(case):
    """The busy engine's pool is small enough that requests that grow preempt (the property above
    covers recompute only where that happens): short prompts, long outputs."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (12,), generator=g).tolist() for _ in range(8)]
    before = case.busy.engine.stats().num_preemptions
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    got = run(case.busy, prompts, [params] * len(prompts))
    assert case.busy.engine.stats().num_preemptions > before
    assert got == [case.reference(p, params) for p in prompts]


def _fixed_workload(vocab: int = 49152) -> tuple[list[list[int]], list[SamplingParams]]:
    """Ten prompts on two shared prefixes, some repeating themselves (drafts), a third of them
    seeded samples."""
    g = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (37, 70)]
    prompts, params = [], []
    for i in range(10):
        suffix = torch.randint(3, vocab, (5 + 7 * i % 23,), generator=g).tolist()
        prompts.append(prefixes[i % 2][: 20 + 5 * i] + suffix * (1 + i % 3))
        sampled = i % 3 == 0
        params.append(
            SamplingParams(
                temperature=0.8 if sampled else 0.0,
                seed=i if sampled else None,
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                logprobs=0,
            )
        )
    return prompts, params


@pytest.mark.e2e
@pytest.mark.parametrize(
    "topology",
    [
        {"engine_core_process": True},
        {"data_parallel_size": 2},
        {"speculative_config": {"model": "<self>", "num_speculative_tokens": 3}},
    ],
    ids=["core-process", "data-parallel", "draft-model"],
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_request_as_if_alone_in_other_topologies(wide_llama, tokenizer_dir, topology, dtype):
    """The engine core in its own process, two data-parallel replicas (requests routed by load and
    prefix), a draft model's speculation: each request's output is its run alone in-thread."""
    common = dict(tokenizer=tokenizer_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN, kv_cache_memory="16MiB", seed=0)
    prompts, params = _fixed_workload()
    alone = LLM(wide_llama, enable_prefix_caching=False, **common)
    expected = [run(alone, [p], [sp])[0] for p, sp in zip(prompts, params)]
    spec = topology.get("speculative_config")
    if spec is not None:
        topology = {"speculative_config": {**spec, "model": wide_llama}}
    llm = LLM(wide_llama, **topology, **common)
    try:
        assert run(llm, prompts, params) == expected
        assert run(llm, prompts, params) == expected  # the prefixes now cached
    finally:
        llm.engine.shutdown()
