"""Property tests of the pure-Python core: budgets, block accounting, no leaks, no deadlock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import FREED, KVCacheManager, cdiv
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams

EOS = 0
MAX_MODEL_LEN = 64

request_st = st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(0, 6))  # prompt, max_tokens, arrival step
workload_st = st.fixed_dictionaries(
    {
        "requests": st.lists(request_st, min_size=1, max_size=12),
        "aborts": st.lists(st.tuples(st.integers(0, 11), st.integers(0, 30)), max_size=4),  # (request, step)
        "block_size": st.sampled_from([1, 2, 4, 16]),
        "spare_blocks": st.integers(0, 20),
        "budget": st.integers(1, 48),
        "max_num_seqs": st.integers(1, 6),
        "eos_every": st.integers(3, 50),
        "window": st.sampled_from([None, None, 2, 9]),  # a sliding window: blocks behind it are freed
    }
)


def _check_blocks(kv: KVCacheManager, scheduler: Scheduler) -> None:
    holders: dict[int, int] = {}
    for blocks in kv.req_blocks.values():
        for block in blocks:
            if block is not FREED:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
    free_ids = set(kv.pool._free)
    for block in kv.pool.blocks:
        # Every block is in exactly one place: free, or held by ref_cnt requests.
        assert block.ref_cnt == holders.get(block.block_id, 0)
        assert (block.block_id in free_ids) == (block.ref_cnt == 0)
    for request in scheduler.running:
        assert len(kv.req_blocks[request.request_id]) == cdiv(request.num_computed_tokens, kv.block_size)


def make_scheduler(w: dict) -> tuple[KVCacheManager, SchedulerConfig, Scheduler]:
    """A scheduler over a pool that holds one max_model_len request plus the workload's spare blocks."""
    kv = KVCacheManager(
        cdiv(MAX_MODEL_LEN, w["block_size"]) + w["spare_blocks"], w["block_size"], sliding_window=w.get("window")
    )
    config = SchedulerConfig(w["max_num_seqs"], w["budget"], MAX_MODEL_LEN)
    return kv, config, Scheduler(config, kv)


@settings(max_examples=150, deadline=None)
@given(workload_st)
def test_scheduler_respects_budgets_and_never_leaks(w):
    block_size = w["block_size"]
    kv, config, scheduler = make_scheduler(w)
    pending = sorted(enumerate(w["requests"]), key=lambda x: x[1][2])
    aborts = {step: f"r{i}" for i, step in w["aborts"]}
    counter = 0
    for step in range(2000):
        while pending and pending[0][1][2] <= step:
            i, (prompt_len, max_tokens, _) = pending.pop(0)
            scheduler.add_request(
                Request(f"r{i}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens), max_tokens, frozenset({EOS}))
            )
        if step in aborts:
            scheduler.finish_request(aborts[step], RequestStatus.FINISHED_ABORTED)
        if not pending and not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        assert output.num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        assert len({s.request_id for s in output.scheduled}) == len(output.scheduled)
        _check_blocks(kv, scheduler)
        result = ModelRunnerOutput()
        for s in output.scheduled:
            assert len(kv.req_blocks[s.request_id]) * block_size >= s.num_computed_tokens + s.num_new_tokens
            if s.sample:
                counter += 1
                result.sampled_token_ids[s.request_id] = [EOS if counter % w["eos_every"] == 0 else 5]
        scheduler.update(output, result)
        _check_blocks(kv, scheduler)
    else:
        raise AssertionError("requests never finished: the scheduler deadlocked")
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not kv.req_blocks and not scheduler.requests


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=10), st.sampled_from([1, 4, 16]))
def test_each_request_finishes_with_its_max_tokens(max_tokens_list, block_size):
    kv = KVCacheManager(cdiv(MAX_MODEL_LEN, block_size), block_size)  # tight: forces preemption
    scheduler = Scheduler(SchedulerConfig(4, 16, MAX_MODEL_LEN), kv)
    requests = [Request(f"r{i}", [1] * 10, SamplingParams(max_tokens=m), m) for i, m in enumerate(max_tokens_list)]
    for r in requests:
        scheduler.add_request(r)
    for _ in range(5000):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        scheduler.update(output, ModelRunnerOutput({s.request_id: [3] for s in output.scheduled if s.sample}))
    assert [r.num_output_tokens for r in requests] == max_tokens_list
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert kv.num_free_blocks == kv.pool.num_blocks
