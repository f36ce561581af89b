"""LoRA adapters: the batched kernel against its torch reference, greedy outputs and logprobs against
transformers + peft on the same tiny model and random adapters, mixed batches bit for bit equal
to each request alone, the prefix cache keyed by adapter, the step's adapter limit, eviction, and
bad adapters refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import hf_greedy, make_model, prompts_of_mixed_lengths
from lora_utils import ALL_TARGETS, load_peft, make_adapter
from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.kernels import cpu_ops
from pagedllm.layers.lora import lora_add_reference, pair_rank_rows
from pagedllm.lora.adapter import read_adapter
from pagedllm.models.gguf import unpermute_qk
from pagedllm.worker.lora_manager import _gguf_tensors

BS = 16
PROMPTS = [[5, 17, 300, 42, 99, 7, 11, 8, 1000, 20], [3, 900, 4, 4, 250, 61, 12000, 33, 5, 6, 71, 2000, 9]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=0)


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> dict[str, str]:
    """Four adapters of the tiny Llama: every target at rank 8; attention only with rsLoRA at rank 4;
    the MLP at rank 16; per-module rank and alpha (PEFT's rank_pattern and alpha_pattern)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all8": make_adapter(llama_dir, root / "all8", rank=8, seed=1),
        "attn4": make_adapter(llama_dir, root / "attn4", rank=4, seed=2, targets=("q_proj", "v_proj"), use_rslora=True),
        "mlp16": make_adapter(
            llama_dir, root / "mlp16", rank=16, seed=3, targets=("gate_proj", "up_proj", "down_proj")
        ),
        "pattern": make_adapter(
            llama_dir, root / "pattern", rank=8, seed=4, rank_pattern={"o_proj": 2}, alpha_pattern={"down_proj": 4}
        ),
    }


def _requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=BS, enable_lora=True, max_loras=4)


def _run(llm: LLM, prompts, lora) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora)
    return [(o.outputs[0].token_ids, [next(iter(e.values())).logprob for e in o.outputs[0].logprobs]) for o in outputs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("size", ["small", "large"])
def test_kernel_matches_reference_and_is_row_invariant(dtype, out_fp32, size):
    """Ranks odd and even, K and N not whole vectors, tiles of 1 to 4 rows of a slot; bf16's B^T in
    pairs of rank rows (the dot-product path where the CPU has AVX512-BF16). Large: the batch's
    tiles on both threads, each row alone on one."""
    if cpu_ops() is None:
        pytest.skip("no C++ kernels")
    g = torch.Generator().manual_seed(0)
    slots, parts, rank, k, n = (3, 3, 8, 70, 150) if size == "small" else (3, 3, 16, 1030, 1550)
    a = torch.randn(slots, parts * rank, k, generator=g).to(dtype)
    bt = torch.randn(slots, rank, n, generator=g).to(dtype)
    if dtype == torch.bfloat16:
        bt = pair_rank_rows(bt)
    ranks = torch.tensor([rank, 3 if size == "small" else 13, 0])
    runs = torch.tensor([[0, 20, 0], [20, 30, 1], [30, 44, 2], [44, n, 0]])
    row_slot = torch.tensor([0, 0, -1, 1, 2, 1, -1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.int32)
    rows = len(row_slot)
    x = torch.randn(rows, k, generator=g).to(dtype)
    base = torch.randn(rows, n, generator=g).to(torch.float32 if out_fp32 else dtype)
    base[row_slot == 2, :3] = torch.tensor([-0.0, 1e-40, -1e-40]).to(base.dtype)  # kept as they are
    ours, ref = base.clone(), base.clone()
    cpu_ops().lora_add(ours, x, a, bt, row_slot, ranks, runs)
    lora_add_reference(ref, x, a, bt, row_slot, ranks, runs)
    # fp32: sums in another order than the reference's (their error grows with K); bf16: x A^T may
    # round to a neighbouring bf16. The updates themselves are of order 10-100.
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol * k / 7, rtol=tol)
    assert torch.equal(ours[row_slot < 0], base[row_slot < 0])  # the base model's rows untouched
    zero = row_slot == 2  # a slot of rank 0 adds nothing: its rows' bits as they were (-0.0 included)
    assert torch.equal(
        ours[zero].view(torch.int16 if dtype == torch.bfloat16 and not out_fp32 else torch.int32),
        base[zero].view(torch.int16 if dtype == torch.bfloat16 and not out_fp32 else torch.int32),
    )
    assert not torch.equal(ours[0], base[0])
    for r in range(rows):  # each row alone: the same bits
        alone = base[r : r + 1].clone()
        cpu_ops().lora_add(alone, x[r : r + 1], a, bt, row_slot[r : r + 1], ranks, runs)
        assert torch.equal(alone[0], ours[r])


def test_bf16_reference_rounds_the_shrink_as_peft_does():
    """bf16 adapters compute as PEFT's bf16 modules: x A^T rounded to bf16, then B, summed in fp32."""
    g = torch.Generator().manual_seed(1)
    x, a, b = (torch.randn(*shape, generator=g).to(torch.bfloat16) for shape in ((5, 64), (6, 64), (40, 6)))
    out = torch.zeros(5, 40, dtype=torch.float32)
    bt = pair_rank_rows(b.T.contiguous()).unsqueeze(0)
    lora_add_reference(
        out, x, a.unsqueeze(0), bt, torch.zeros(5, dtype=torch.int32), torch.tensor([6]), torch.tensor([[0, 40, 0]])
    )
    want = (x.float() @ a.float().T).to(torch.bfloat16).float() @ b.float().T
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, x.float() @ a.float().T @ b.float().T, atol=1e-5, rtol=1e-5)


def test_greedy_and_logprobs_equal_peft(llm, llama_dir, adapters):
    for name, lora in _requests(adapters).items():
        peft = load_peft(llama_dir, adapters[name])
        ours = _run(llm, PROMPTS, lora)
        for prompt, (tokens, logprobs) in zip(PROMPTS, ours):
            want_tokens, want_logprobs, _ = hf_greedy(peft, prompt, GREEDY.max_tokens)
            assert tokens == want_tokens, name
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=1e-4)
    base = _run(llm, PROMPTS, None)
    assert all(base[0][0] != _run(llm, PROMPTS[:1], lora)[0][0] for lora in _requests(adapters).values())


def test_mixed_batch_equals_each_request_alone(llm, adapters):
    """Four adapters and the base model in one batch: every request's tokens and logprobs are those
    it has alone, bit for bit (the kernels compute each row on its own)."""
    loras = [*_requests(adapters).values(), None]
    prompts = [p for p in PROMPTS for _ in loras]
    together = _run(llm, prompts, [lora for _ in PROMPTS for lora in loras])
    alone = [_run(llm, [p], lora)[0] for p in PROMPTS for lora in loras]
    assert together == alone


def test_step_runs_at_most_max_loras_adapters(llama_dir, adapters, llm):
    small = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=BS, enable_lora=True, max_loras=2)
    scheduler = small.engine.core.scheduler
    schedule, seen = scheduler.schedule, []

    def counting():
        output = schedule()
        seen.append({scheduler.requests[r.request_id].lora_id for r in output.scheduled} - {0})
        return output

    scheduler.schedule = counting
    loras = [*_requests(adapters).values(), None]
    prompts = [p for p in PROMPTS for _ in loras]
    which = [lora for _ in PROMPTS for lora in loras]
    assert _run(small, prompts, which) == _run(llm, prompts, which)
    assert max(len(s) for s in seen) == 2
    manager = small.engine.model_runner.lora
    assert len(manager.loaded) <= 2  # max_cpu_loras defaults to max_loras


def test_prefix_cache_keys_blocks_by_adapter(llama_dir, adapters):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=BS, enable_lora=True, max_loras=2)
    engine = llm.engine
    prompt = list(range(100, 100 + 3 * BS + 5))
    loras = _requests(adapters)
    alone_base = _run(llm, [prompt], None)
    hits = engine.stats().prefix_cache_hits
    under = _run(llm, [prompt], loras["all8"])
    assert engine.stats().prefix_cache_hits == hits  # the base model's blocks are not the adapter's
    assert _run(llm, [prompt], loras["attn4"]) != under
    assert engine.stats().prefix_cache_hits == hits
    assert _run(llm, [prompt], loras["all8"]) == under
    assert engine.stats().prefix_cache_hits == hits + 3 * BS  # its own blocks hit
    assert _run(llm, [prompt], None) == alone_base


def test_cpu_cache_evicts_least_recently_used(llama_dir, adapters, llm):
    small = LLM(
        llama_dir,
        dtype="float32",
        kv_cache_memory="32MiB",
        block_size=BS,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
    )
    manager = small.engine.model_runner.lora
    for lora in _requests(adapters).values():
        assert _run(small, PROMPTS[:1], lora) == _run(llm, PROMPTS[:1], lora)
        assert len(manager.loaded) <= 2
    assert list(manager.loaded) == [3, 4]  # the two used last


def _write_config(path, **changes) -> None:
    config_file = os.path.join(path, "adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_file, "w") as f:
        json.dump(config, f)


def test_bad_adapters_are_refused_by_name(llm, llama_dir, adapters, tmp_path, tokenizer_dir):
    def refused(lora: LoRARequest, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            _run(llm, PROMPTS[:1], lora)

    refused(LoRARequest("missing", 10, str(tmp_path / "nowhere")), "does not exist")
    big = make_adapter(llama_dir, tmp_path / "big", rank=32, seed=5)
    refused(LoRARequest("big", 11, big), "rank 32, over --max-lora-rank 16")
    head = make_adapter(llama_dir, tmp_path / "head", rank=4, seed=6, targets=("q_proj", "lm_head"))
    refused(LoRARequest("head", 12, head), "lm_head")
    other = make_model("llama", tmp_path / "wide", tokenizer_dir, hidden_size=96, num_attention_heads=4)
    refused(LoRARequest("wide", 13, make_adapter(other, tmp_path / "wide_adapter", rank=4)), "does not fit this model")
    dora = make_adapter(llama_dir, tmp_path / "dora", rank=4, seed=7)
    _write_config(dora, use_dora=True)
    refused(LoRARequest("dora", 14, dora), "use_dora")
    refused(LoRARequest("again", 1, adapters["attn4"]), "already")  # id 1 is all8's (the fixture ran it)
    no_lora = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="--enable-lora"):
        _run(no_lora, PROMPTS[:1], LoRARequest("all8", 1, adapters["all8"]))
    # The engine is unharmed.
    assert _run(llm, PROMPTS[:1], _requests(adapters)["all8"]) == _run(
        llm, PROMPTS[:1], LoRARequest("all8", 1, adapters["all8"])
    )


def test_adapter_ranks_and_scalings_as_peft_sets_them(adapters):
    pattern = {m.name.rsplit(".", 1)[1]: m for m in read_adapter(adapters["pattern"]).modules}
    assert set(pattern) == set(ALL_TARGETS)
    assert (pattern["o_proj"].rank, pattern["o_proj"].scaling) == (2, 8.0)  # alpha 16 / rank 2
    assert (pattern["down_proj"].rank, pattern["down_proj"].scaling) == (8, 0.5)  # alpha 4 / rank 8
    assert (pattern["q_proj"].rank, pattern["q_proj"].scaling) == (8, 2.0)
    rs = read_adapter(adapters["attn4"]).modules
    assert {m.name.rsplit(".", 1)[1] for m in rs} == {"q_proj", "v_proj"}
    assert all(m.scaling == 16 / 2 for m in rs)  # rsLoRA: alpha / sqrt(rank)


WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64, initializer_range=0.05)


@pytest.fixture(scope="module")
def wide(tmp_path_factory, tokenizer_dir) -> tuple[str, str]:
    """A Llama of real models' weight scale (the quantized kernels' rows of 256) and an adapter."""
    path = make_model("llama", tmp_path_factory.mktemp("wide-llama"), tokenizer_dir, **WIDE)
    return path, make_adapter(path, tmp_path_factory.mktemp("wide-adapter"), rank=16, seed=8, scale=0.1)


def _teacher_forced(llm: LLM, sequences: list[list[int]], lora: LoRARequest | None) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False, lora_request=lora)
    return torch.cat(
        [torch.tensor([e[t].logprob for e, t in zip(o.prompt_logprobs[1:], s[1:])]) for o, s in zip(outputs, sequences)]
    )


@pytest.mark.skipif(cpu_ops() is None, reason="quantized weights need the C++ kernels")
@pytest.mark.parametrize(
    "base, bound, margin",
    [("int8", 0.05, 10), ("int4", 0.4, 2), ("Q8_0", 0.04, 10), ("Q4_K", 0.04, 10)],
    ids=lambda v: str(v),
)
def test_adapter_on_a_quantized_base(wide, tokenizer_dir, tmp_path, base, bound, margin):
    """The adapter beside quantized weights: teacher-forced logprobs within the base's own rounding of
    the float model's with the adapter (online schemes: the float checkpoint, test_online_quantization's
    bounds; GGUF: the same file dequantized, test_gguf_quantized's), far from the quantized model's
    without it (int4's rounding, 0.18 nats mean there, leaves the adapter's effect 4-5 times it);
    a mixed batch bit for bit each request alone."""
    from gguf_writer import write_gguf

    hf_dir, adapter = wide
    args = dict(dtype="float32", kv_cache_memory="32MiB", enable_lora=True, max_loras=2)
    if base.startswith("int"):
        quantized = LLM(hf_dir, quantization=base, **args)
        plain = LLM(hf_dir, **args)
    else:
        path = str(tmp_path / "model.gguf")
        write_gguf(hf_dir, path, base, None, {"attn_v": "Q6_K", "ffn_down": "Q6_K"} if base == "Q4_K" else None)
        quantized = LLM(path, tokenizer=tokenizer_dir, **args)
        plain = LLM(path, tokenizer=tokenizer_dir, quantization="none", **args)  # the same file, dequantized
    layers = quantized.engine.model_runner.model.model.layers[0]
    assert layers.mlp.gate_up_proj.formats[0] == base
    lora = LoRARequest("wide", 1, adapter)
    sequences = [s for s in prompts_of_mixed_lengths(1000, seed=5) if len(s) > 1]
    with_adapter = _teacher_forced(quantized, sequences, lora)
    delta = (with_adapter - _teacher_forced(plain, sequences, lora)).abs()
    effect = (with_adapter - _teacher_forced(quantized, sequences, None)).abs()
    print(f"{base}: mean {delta.mean():.4f} max {delta.max():.4f}; the adapter's own effect {effect.mean():.3f}")
    assert delta.mean() < bound and effect.mean() > margin * bound
    loras = [lora, None, LoRARequest("wide2", 2, adapter)]
    together = _run(quantized, [PROMPTS[0]] * 3, loras)
    assert together == [_run(quantized, PROMPTS[:1], lora)[0] for lora in loras]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_under_adapters_keeps_greedy_outputs(llm, llama_dir, adapters, method):
    """Drafts (n-gram, or the base model as the draft, without the adapter) verified under each
    request's adapter, in one mixed batch: the tokens and logprobs of the engine without speculation."""
    from test_spec_decode import SPEC, fixed_drafts, repetitive_prompts

    spec = SPEC if method == "ngram" else {"model": llama_dir, "num_speculative_tokens": 3}
    args = dict(dtype="float32", kv_cache_memory="32MiB", block_size=BS, enable_lora=True, max_loras=4)
    speculative = fixed_drafts(LLM(llama_dir, speculative_config=spec, **args))
    loras = [*_requests(adapters).values(), None]
    repetitive = repetitive_prompts(llm.engine.model_config.vocab_size)
    prompts = [repetitive[i % len(repetitive)] for i in range(len(loras))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outputs = [
        engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
        for engine in (speculative, llm)
    ]
    for ours, plain in zip(*outputs):
        assert ours.outputs[0].token_ids == plain.outputs[0].token_ids
        got, want = ([next(iter(e.values())).logprob for e in o.outputs[0].logprobs] for o in (ours, plain))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)
    assert speculative.engine.stats().spec_num_draft_tokens > 0


def test_two_tensor_parallel_ranks_give_one_ranks_outputs(llm, llama_dir, adapters):
    """Adapters split like their layers: q/k/v, gate/up B by output rows, o and down A by input columns."""
    loras = [*_requests(adapters).values(), None]
    tp = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", enable_lora=True, max_loras=4, tensor_parallel_size=2)
    try:
        ours = _run(tp, PROMPTS * len(loras), [lora for lora in loras for _ in PROMPTS])
    finally:
        tp.engine.shutdown()
    want = _run(llm, PROMPTS * len(loras), [lora for lora in loras for _ in PROMPTS])
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in want]
    for (_, got), (_, expected) in zip(ours, want):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=1e-4)


def test_bf16_mixed_batch_equals_alone_and_is_near_fp32(wide):
    """bf16 (the packed layouts where the CPU has AVX512-BF16: gate/up interleaved, which the
    adapter's columns follow), a batch of two adapters and the base bit for bit each alone."""
    hf_dir, adapter = wide
    args = dict(kv_cache_memory="32MiB", enable_lora=True, max_loras=2)
    bf16 = LLM(hf_dir, dtype="bfloat16", **args)
    loras = [LoRARequest("wide", 1, adapter), None, LoRARequest("wide2", 2, adapter)]
    assert _run(bf16, [PROMPTS[1]] * 3, loras) == [_run(bf16, PROMPTS[1:], lora)[0] for lora in loras]
    sequences = [s for s in prompts_of_mixed_lengths(1000, seed=6) if len(s) > 1]
    fp32 = LLM(hf_dir, dtype="float32", **args)
    delta = (_teacher_forced(bf16, sequences, loras[0]) - _teacher_forced(fp32, sequences, loras[0])).abs()
    effect = (_teacher_forced(bf16, sequences, None) - _teacher_forced(bf16, sequences, loras[0])).abs()
    assert delta.mean() < 0.05 and effect.mean() > 10 * delta.mean(), (delta.mean(), effect.mean())


def test_an_odd_rank_in_bf16_is_near_fp32(llama_dir, tmp_path):
    """An adapter of rank 5 under --max-lora-rank 5 in bf16 (slots of an even rank, B^T in pairs, the
    last pair half zero): teacher-forced logprobs near fp32's with the adapter, far from none."""
    adapter = make_adapter(llama_dir, tmp_path / "odd", rank=5, seed=9)
    args = dict(kv_cache_memory="32MiB", enable_lora=True, max_lora_rank=5)
    bf16, fp32 = (LLM(llama_dir, dtype=dtype, **args) for dtype in ("bfloat16", "float32"))
    lora = LoRARequest("odd", 1, adapter)
    sequences = [s for s in prompts_of_mixed_lengths(1000, seed=7) if len(s) > 1]
    delta = (_teacher_forced(bf16, sequences, lora) - _teacher_forced(fp32, sequences, lora)).abs()
    effect = (_teacher_forced(bf16, sequences, None) - _teacher_forced(bf16, sequences, lora)).abs()
    assert effect.mean() > 10 * delta.mean(), (delta.mean(), effect.mean())


def test_the_cpp_stack_takes_adapter_layers_bit_for_bit(llama_dir, adapters):
    """With adapters the decoder layers still run as one C++ call (each linear layer a LoRALinear),
    the op-by-op path's results bit for bit, in a mixed batch and alone."""
    if cpu_ops() is None:
        pytest.skip("no C++ kernels")
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=BS, enable_lora=True, max_loras=4)
    model = llm.engine.model_runner.model
    assert model.stack is not None
    loras = [*_requests(adapters).values(), None]
    prompts = [p for p in PROMPTS for _ in loras]
    which = [lora for _ in PROMPTS for lora in loras]
    stacked = _run(llm, prompts, which)
    stack, model.stack = model.stack, None  # the documented test hook: op by op
    try:
        assert _run(llm, prompts, which) == stacked
    finally:
        model.stack = stack


def test_an_adapter_in_use_is_never_dropped(llama_dir, adapters, tmp_path):
    """The worker keeps loaded every adapter a request it holds runs under, past --max-cpu-loras: a
    dropped one would be read again (and here fail: its files are gone); the others go least
    recently used first."""
    import shutil

    small = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", enable_lora=True, max_loras=1, max_cpu_loras=1)
    manager = small.engine.model_runner.lora
    copies = [shutil.copytree(adapters[name], tmp_path / name) for name in ("all8", "mlp16", "attn4")]
    a, b, c = (LoRARequest(f"x{i}", 100 + i, str(path)) for i, path in enumerate(copies))
    manager.prepare_step([a], [3], live={100})
    manager.prepare_step([b], [3], live={100, 101})  # a's request still runs
    assert list(manager.loaded) == [100, 101]
    shutil.rmtree(copies[0])
    manager.prepare_step([a], [3], live={100, 101})  # in memory still: not read again
    manager.prepare_step([c], [3], live={102})  # a's and b's requests are gone
    assert list(manager.loaded) == [102]
    with pytest.raises(ValueError, match="does not exist"):
        manager.prepare_step([a], [3], live={100})


GGUF_ADAPTER = os.path.join(os.path.dirname(__file__), "data", "llama-tiny-lora-f32.gguf")
GGUF_RANK, GGUF_SEED = 8, 47  # tests/data/make_gguf_lora.py's


def test_llama_cpp_gguf_adapter_equals_its_peft_source(llm, llama_dir, tmp_path):
    """llama.cpp's converter's GGUF adapter (tests/data/make_gguf_lora.py) of a PEFT adapter made
    again here: the file still holds that adapter's weights (B's q/k rows un-permuted), and it
    serves the same tokens and logprobs, bit for bit, as its source, which equals transformers + peft."""
    source = make_adapter(llama_dir, tmp_path / "source", rank=GGUF_RANK, seed=GGUF_SEED)
    info = read_adapter(GGUF_ADAPTER)
    assert info.gguf_arch == "llama" and {m.scaling for m in info.modules} == {2.0}  # alpha 16 / rank 8
    tensors, peft = _gguf_tensors(GGUF_ADAPTER), read_adapter(source)
    theirs = load_file(peft.weights_file)
    for ours_module, peft_module in zip(info.modules, peft.modules, strict=True):
        assert ours_module.name == peft_module.name
        a, b = (tensors[n] for n in ours_module.tensors)
        if ours_module.name.endswith(("q_proj", "k_proj")):
            b = unpermute_qk(b, 4 if ours_module.name.endswith("q_proj") else 2)
        assert torch.equal(a, theirs[peft_module.tensors[0]]) and torch.equal(b, theirs[peft_module.tensors[1]])
    from_gguf = _run(llm, PROMPTS, LoRARequest("gguf", 20, GGUF_ADAPTER))
    assert from_gguf == _run(llm, PROMPTS, LoRARequest("peft", 21, source))
    want = hf_greedy(load_peft(llama_dir, source), PROMPTS[0], GREEDY.max_tokens)[0]
    assert from_gguf[0][0] == want
