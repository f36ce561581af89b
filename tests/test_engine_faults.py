"""A failure inside a step ends the requests it can be pinned on; the engine and the others go on."""

from __future__ import annotations

import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.engine.faults import FaultInjector

FAULT = 4242
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", max_model_len=128)
    llm.engine.faults.token = FAULT  # as PAGEDLLM_FAULT=token:4242 would set it
    return llm


def _all_blocks_free(llm: LLM) -> bool:
    stats = llm.engine.stats()
    return not llm.engine.has_unfinished_requests() and stats.kv_blocks_free == stats.kv_blocks_total


def test_the_failing_request_alone_ends_with_an_error(llm):
    good = [[11, 12, 13], [21, 22, 23, 24], [31, 32]]
    alone = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in good]
    prompts = [{"prompt_token_ids": p} for p in good[:2] + [[5, FAULT, 6]] + good[2:]]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for i, o in enumerate(outputs) if i != 2] == alone
    failed = outputs[2]
    assert failed.finished and failed.outputs[0].finish_reason == "error" and "injected fault" in failed.error
    assert all(o.error is None for i, o in enumerate(outputs) if i != 2)
    assert _all_blocks_free(llm)


def test_a_step_rerun_after_the_worker_took_its_message_changes_no_output(llm, monkeypatch):
    """The worker takes a step's deltas in before the forward pass and appends what it samples
    last; a step that fails after sampling is rerun request by request with the same message."""
    prompts = [{"prompt_token_ids": p} for p in ([11, 12, 13], [21, 22, 23, 24], [31, 32])]
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    runner = llm.engine.model_runner
    prompt_logprobs = runner._prompt_logprobs

    def failing_when_batched(hidden, scheduled, *args):
        if len(scheduled) > 1:
            raise RuntimeError("a batch that fails after sampling")
        return prompt_logprobs(hidden, scheduled, *args)

    monkeypatch.setattr(runner, "_prompt_logprobs", failing_when_batched)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == clean
    assert _all_blocks_free(llm)


# The fault in the held prompt the samples fork from, or in the last prompt token each sample computes.
@pytest.mark.parametrize("prompt", [[FAULT, 7, 8], [7, 8, FAULT]])
def test_a_failing_request_with_parallel_samples_ends_every_sample(llm, prompt):
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    failed, fine = llm.generate([{"prompt_token_ids": prompt}, "hello"], params, use_tqdm=False)
    assert [s.finish_reason for s in failed.outputs] == ["error"] * 3 and failed.error
    assert [s.finish_reason for s in fine.outputs] == ["length"] * 3
    assert _all_blocks_free(llm)


def test_a_failing_beam_raises_and_frees_its_blocks(llm):
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.beam_search([[9, FAULT, 10]], BeamSearchParams(beam_width=2, max_tokens=4))
    assert _all_blocks_free(llm)
    assert llm.beam_search([[9, 10]], BeamSearchParams(beam_width=2, max_tokens=4))[0].sequences


def test_a_fault_outside_the_model_runner_stops_the_step(llama_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_FAULT", "fatal:1")
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", max_model_len=128)
    with pytest.raises(RuntimeError, match="injected fatal fault"):
        llm.generate(["hello"], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("spec", ["token", "token:x", "boom:1", "slow:-1"])
def test_bad_fault_specs_are_refused(spec, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_FAULT", spec)
    with pytest.raises(ValueError, match="PAGEDLLM_FAULT"):
        FaultInjector.from_env()
