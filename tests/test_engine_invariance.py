"""Greedy output does not depend on batching, chunking, preemption or block size."""

from __future__ import annotations

import pytest

from conftest import prompts_of_mixed_lengths
from pagedllm import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return prompts_of_mixed_lengths(49152, seed=2) + prompts_of_mixed_lengths(49152, seed=3)[2:]


@pytest.fixture(scope="module")
def reference(llama_dir, prompts):
    """Each request alone, in a roomy engine with one big chunk."""
    llm = LLM(llama_dir, dtype="float32", block_size=16, kv_cache_memory="64MiB")
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def _run(llama_dir, prompts, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(llama_dir, dtype="float32", **kwargs)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def test_all_together_equals_alone(llama_dir, prompts, reference):
    tokens, llm = _run(llama_dir, prompts, kv_cache_memory="64MiB")
    assert tokens == reference
    assert llm.engine.stats().kv_blocks_free == llm.engine.stats().kv_blocks_total


def test_small_prefill_chunks(llama_dir, prompts, reference):
    tokens, _ = _run(llama_dir, prompts, max_num_batched_tokens=7, block_size=4, kv_cache_memory="64MiB")
    assert tokens == reference


def test_preemption_keeps_greedy_output(llama_dir, prompts, reference):
    # 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes = 512 B per token: room for 128 tokens,
    # just max_model_len, while the batch holds about 350: requests must be preempted.
    tokens, llm = _run(llama_dir, prompts, block_size=4, kv_cache_memory=128 * 512, max_model_len=128)
    assert llm.engine.stats().num_preemptions > 0
    assert tokens == reference


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_block_sizes(llama_dir, prompts, reference, block_size):
    tokens, _ = _run(llama_dir, prompts, block_size=block_size, kv_cache_memory="64MiB")
    assert tokens == reference


def test_max_num_seqs_one(llama_dir, prompts, reference):
    tokens, _ = _run(llama_dir, prompts, max_num_seqs=1, kv_cache_memory="64MiB")
    assert tokens == reference


def test_prefill_held_beside_decodes(llama_dir, prompts, reference):
    # The short prompts start generating; then the long ones (over 4% of max_model_len: 17, 40 and
    # 73 tokens) arrive and prefill beside them, held to a token or two a step.
    llm = LLM(llama_dir, dtype="float32", max_model_len=256, long_prefill_token_threshold=1, kv_cache_memory="64MiB")
    engine, scheduler = llm.engine, llm.engine.core.scheduler
    schedule, held = scheduler.schedule, []

    def recording():
        output = schedule()
        decodes = [s for s in output.scheduled if s.sample and s.num_new_tokens == 1 and s.num_computed_tokens]
        if decodes:  # long prompts' chunks beside a decode
            long = [s for s in output.scheduled if scheduler.requests[s.request_id].num_prompt_tokens > 10]
            held.extend(s.num_new_tokens for s in long if not s.sample)
        return output

    scheduler.schedule = recording
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) > 10)
    ids = {engine.add_request(None, prompts[i], PARAMS): i for i in order if len(prompts[i]) <= 10}
    engine.step()
    engine.step()  # the short ones generating
    ids.update({engine.add_request(None, prompts[i], PARAMS): i for i in order if len(prompts[i]) > 10})
    tokens = {}
    while engine.has_unfinished_requests():
        tokens.update({ids[o.request_id]: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [tokens[i] for i in range(len(prompts))] == reference
    assert len(held) >= 5 and max(held) <= 2  # unheld, the first step beside a decode takes them whole
