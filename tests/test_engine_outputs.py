"""LLMEngine outputs: delta vs cumulative, prompt scoring with max_tokens=0, aborts, stats."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(EngineArgs(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=4))


def _drain(engine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_delta_outputs_add_up_to_the_cumulative_ones(engine):
    def run(kind):
        params = SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, n=2, seed=3, output_kind=kind
        )
        engine.add_request("x", "Hello there, general", params)
        return _drain(engine)

    cumulative = run(RequestOutputKind.CUMULATIVE)
    deltas = run(RequestOutputKind.DELTA)
    final = {o.index: o for o in cumulative[-1].outputs}
    for index in (0, 1):
        pieces = [o for out in deltas for o in out.outputs if o.index == index]
        assert "".join(p.text for p in pieces) == final[index].text
        assert sum((p.token_ids for p in pieces), []) == final[index].token_ids
        assert sum((p.logprobs for p in pieces), []) == final[index].logprobs
        assert [p.finish_reason for p in pieces][-1] == "length"
        assert all(p.finish_reason is None for p in pieces[:-1])
    assert deltas[-1].finished and cumulative[-1].finished


def test_max_tokens_zero_scores_the_prompt(engine):
    prompt = [5, 17, 300, 4000, 12]
    engine.add_request("score", prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
    (output,) = [o for o in _drain(engine) if o.finished]
    assert output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "length"
    assert output.prompt_logprobs[0] is None
    assert [next(iter(entry)) for entry in output.prompt_logprobs[1:]] == prompt[1:]


def test_abort_frees_blocks_and_stats_add_up(engine):
    for i in range(3):
        engine.add_request(f"a{i}", "word " * 30, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    stats = engine.stats()
    assert stats.num_running + stats.num_waiting == 3
    assert stats.kv_blocks_free < stats.kv_blocks_total
    assert 0.0 <= stats.kv_waste < 0.5
    for i in range(3):
        engine.abort_request(f"a{i}")
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_free) == (0, 0, stats.kv_blocks_total)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hi", SamplingParams())
        engine.add_request("dup", "hi", SamplingParams())
    engine.abort_request("dup")
