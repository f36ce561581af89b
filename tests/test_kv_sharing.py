"""KV sharing through the engine: prefix caching, parallel samples with copy-on-write, beam search."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.core.block_pool import KVBlock
from pagedllm.core.kv_cache_manager import KVCacheManager

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BS = 4


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    base = torch.randint(3, 40000, (41,), generator=g).tolist()
    tail = lambda n: torch.randint(3, 40000, (n,), generator=g).tolist()  # noqa: E731
    return [
        base,
        base[:2] + tail(9),  # part of a block shared
        base[:4] + tail(7),  # exactly one block
        base[:5] + tail(3),  # one block and a bit
        base[:37] + tail(6),  # many blocks
        base[:40],
    ]  # the whole cached run but the last token


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=BS, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


def test_prompt_logprobs_are_whole_when_the_prefix_is_cached(llama_dir):
    """Cached blocks hold K/V, not logits: a request asking for prompt logprobs computes its prompt."""
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=BS)
    prompt = _prompts()[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    first, again = (llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0] for _ in range(2))
    assert first.prompt_logprobs[0] is None and all(e is not None for e in again.prompt_logprobs[1:])
    assert [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in again.prompt_logprobs[1:]] == [
        {t: round(lp.logprob, 4) for t, lp in e.items()} for e in first.prompt_logprobs[1:]
    ]


def test_prefix_caching_keeps_greedy_output(llama_dir, reference):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=BS)
    prompts = _prompts()
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # fills the cache with the shared prefix
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == reference
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == (0 + 1 + 1 + 9 + 9) * BS  # full shared blocks, last token recomputed
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_request_arriving_while_its_prefix_is_prefilled(llama_dir, reference):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=BS, max_num_batched_tokens=8)
    engine = llm.engine
    prompts = _prompts()
    engine.add_request("first", prompts[0], GREEDY)
    for _ in range(3):  # 24 of its 41 prompt tokens computed
        engine.step()
    engine.add_request("late", prompts[4], GREEDY)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    assert outputs["first"].outputs[0].token_ids == reference[0]
    assert outputs["late"].outputs[0].token_ids == reference[4]
    assert engine.stats().prefix_cache_hits >= 6 * BS  # at least the blocks computed before it came


def test_parallel_samples_prefill_once_and_are_reproducible(llama_dir):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=BS, enable_prefix_caching=False)
    computed = []
    execute = llm.engine.model_runner.execute

    def counting(output):
        computed.append(output.num_scheduled_tokens)
        return execute(output)

    llm.engine.model_runner.execute = counting
    prompt = _prompts()[0]
    params = SamplingParams(n=4, seed=3, temperature=1.0, max_tokens=6, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    # One pass over the 41-token prompt but its last token; then 6 steps of the 4 samples: the
    # first computes that last token for each (logits to draw its first token from).
    assert computed == [len(prompt) - 1] + [4] * 6
    samples = [o.token_ids for o in first.outputs]
    assert len(set(map(tuple, samples))) > 1 and all(len(s) == 6 for s in samples)
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == samples
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_parallel_greedy_samples_equal_a_single_greedy_run(llama_dir, reference):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=BS)
    params = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(_prompts()[:2], params, use_tqdm=False)
    for output, expected in zip(outputs, reference):
        assert [o.token_ids for o in output.outputs] == [expected] * 3


def test_write_into_shared_block_is_caught_in_debug_mode():
    kv = KVCacheManager(4, BS, debug=True)
    shared = KVBlock(0, ref_cnt=2)
    with pytest.raises(AssertionError, match="shared"):
        kv._check_writable([shared], 1, 1)


@pytest.mark.parametrize("beam_width, length_penalty", [(2, 1.0), (4, 0.5)])
def test_beam_search_matches_transformers(llama_dir, beam_width, length_penalty):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=BS)
    prompts = [_prompts()[1], _prompts()[4]]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=6, ignore_eos=True, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        # No EOS (ignore_eos here, eos_token_id=None there): both run every beam to max_tokens.
        expected = hf.generate(
            torch.tensor([prompt]),
            num_beams=beam_width,
            do_sample=False,
            max_new_tokens=6,
            length_penalty=length_penalty,
            eos_token_id=None,
            pad_token_id=0,
            num_return_sequences=beam_width,
            output_scores=True,
            return_dict_in_generate=True,
        )
        best = output.sequences[0]
        assert best.tokens == expected.sequences[0].tolist()
        assert len(output.sequences) == beam_width
        scores = [s.score for s in output.sequences]
        assert scores == sorted(scores, reverse=True)
        torch.testing.assert_close(torch.tensor(scores), expected.sequences_scores.float(), atol=1e-4, rtol=1e-4)
        assert all(s.cum_logprob / 6**length_penalty == pytest.approx(s.score) for s in output.sequences)
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and not llm.engine.core.scheduler.held


def test_cache_salt_keeps_prefixes_apart(llama_dir):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=BS)
    engine = llm.engine
    prompt = _prompts()[0]

    def run(request_id: str, salt: str | None) -> None:
        processed = engine.process_inputs(prompt, GREEDY)
        processed.cache_salt = salt
        engine.add_processed(request_id, processed)
        while engine.has_unfinished_requests():
            engine.step()

    run("a", "alice")
    run("b", "bob")
    assert engine.stats().prefix_cache_hits == 0
    run("c", "alice")
    assert engine.stats().prefix_cache_hits == (len(prompt) - 1) // BS * BS
