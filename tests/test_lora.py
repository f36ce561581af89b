"""LoRA adapters: the batched kernel against its torch reference, greedy outputs and logprobs against
transformers + peft on the same tiny model and random adapters, mixed batches bit for bit equal
to each request alone, the prefix cache keyed by adapter, the step's adapter limit, eviction, and
bad adapters refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import hf_greedy, make_model
from lora_utils import ALL_TARGETS, load_peft, make_adapter
from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.kernels import cpu_ops
from pagedllm.layers.lora import lora_add_reference
from pagedllm.lora.adapter import read_adapter

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
def test_kernel_matches_reference_and_is_row_invariant(dtype, out_fp32):
    if cpu_ops() is None:
        pytest.skip("no C++ kernels")
    g = torch.Generator().manual_seed(0)
    slots, parts, rank, k, n, rows = 3, 3, 8, 70, 50, 9
    a = torch.randn(slots, parts * rank, k, generator=g).to(dtype)
    bt = torch.randn(slots, rank, n, generator=g).to(dtype)
    ranks = torch.tensor([8, 3, 0])
    runs = torch.tensor([[0, 20, 0], [20, 30, 1], [30, 44, 2], [44, 50, 0]])
    x = torch.randn(rows, k, generator=g).to(dtype)
    base = torch.randn(rows, n, generator=g).to(torch.float32 if out_fp32 else dtype)
    row_slot = torch.tensor([0, 0, -1, 1, 2, 1, -1, 0, 1], dtype=torch.int32)
    ours, ref = base.clone(), base.clone()
    cpu_ops().lora_add(ours, x, a, bt, row_slot, ranks, runs)
    lora_add_reference(ref, x, a, bt, row_slot, ranks, runs)
    tol = 1e-4 if dtype == torch.float32 and out_fp32 else 2e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol * 10, rtol=tol)
    assert torch.equal(ours[row_slot < 0], base[row_slot < 0])  # the base model's rows untouched
    assert torch.equal(ours[4], base[4])  # a slot of rank 0 adds nothing
    assert not torch.equal(ours[0], base[0])
    for r in range(rows):  # each row alone: the same bits
        alone = base[r : r + 1].clone()
        cpu_ops().lora_add(alone, x[r : r + 1], a, bt, row_slot[r : r + 1], ranks, runs)
        assert torch.equal(alone[0], ours[r])


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
