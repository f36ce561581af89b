"""Property tests of the pure-Python core: budgets, block accounting, no leaks, no deadlock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import FREED, KVCacheManager, cdiv
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step import ModelRunnerOutput
from pagedllm.lora.request import LoRARequest
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
        "threshold": st.sampled_from([0, 0, 0.5, 1, 3, 16]),  # long_prefill_token_threshold
        "keys": st.sampled_from([0.0, 5.0, 40.0]),  # attention_keys_per_token
        "adapters": st.integers(0, 3),  # LoRA adapters the requests take in turn (with the base model)
        "max_loras": st.sampled_from([1, 2]),
        "policy": st.sampled_from(["fcfs", "priority"]),
        "priorities": st.lists(st.integers(-2, 2), min_size=12, max_size=12),  # under the priority policy
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
    config = SchedulerConfig(
        w["max_num_seqs"],
        w["budget"],
        MAX_MODEL_LEN,
        long_prefill_token_threshold=w.get("threshold", 0),
        attention_keys_per_token=w.get("keys", 0.0),
        max_loras=w.get("max_loras", 0),
        policy=w.get("policy", "fcfs"),
    )
    return kv, config, Scheduler(config, kv)


def prompt_cost(start: int, count: int, keys: float) -> float:
    """Prompt tokens start..start+count: a token each, plus each one's keys (itself and all before it)."""
    return sum(1 + ((q + 1) / keys if keys else 0.0) for q in range(start, start + count))


def _check_prefill_held(scheduler: Scheduler, output, room: float, held: set[str]) -> None:
    """While requests decode, the step's chunks of `held` prompts (long ones that arrived beside a
    generating request) cost at most the room (or are one token)."""
    keys = scheduler.config.attention_keys_per_token
    requests = [(s, scheduler.requests[s.request_id]) for s in output.scheduled]
    chunks = [s for s, r in requests if r.num_tokens - s.num_computed_tokens > 1 and r.request_id in held]
    total = sum(prompt_cost(s.num_computed_tokens, s.num_new_tokens, keys) for s in chunks)
    assert total <= room + 1e-9 or (len(chunks) == 1 and chunks[0].num_new_tokens == 1)


def _room(scheduler: Scheduler) -> float:
    """The prefill room by its definition: the threshold's share of the decoding requests' tokens and keys."""
    config = scheduler.config
    decoding = [r for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
    if not config.long_prefill_token_threshold or not decoding:
        return float("inf")
    keys = config.attention_keys_per_token
    return config.long_prefill_token_threshold * sum(
        1 + (r.num_computed_tokens / keys if keys else 0) for r in decoding
    )


@settings(max_examples=150, deadline=None)
@given(workload_st)
def test_scheduler_respects_budgets_and_never_leaks(w):
    block_size = w["block_size"]
    kv, config, scheduler = make_scheduler(w)
    pending = sorted(enumerate(w["requests"]), key=lambda x: x[1][2])
    aborts = {step: f"r{i}" for i, step in w["aborts"]}
    counter = 0
    held: set[str] = set()  # long prompts (over 4% of max_model_len) that arrived beside a generating request
    for step in range(2000):
        while pending and pending[0][1][2] <= step:
            i, (prompt_len, max_tokens, _) = pending.pop(0)
            if prompt_len > 0.04 * MAX_MODEL_LEN and any(r.num_output_tokens for r in scheduler.running):
                held.add(f"r{i}")
            adapter = i % (w["adapters"] + 1)
            lora = LoRARequest(f"a{adapter}", adapter, "/adapters/a") if adapter else None
            request = Request(
                f"r{i}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens), max_tokens, frozenset({EOS})
            )
            request.lora_request = lora
            if w["policy"] == "priority":
                request.priority = w["priorities"][i]
            scheduler.add_request(request)
        if step in aborts:
            scheduler.finish_request(aborts[step], RequestStatus.FINISHED_ABORTED)
        if not pending and not scheduler.has_unfinished_requests():
            break
        if w["policy"] == "priority":  # (its preemptions first: the room is the decoders' that remain)
            scheduler._preempt_for_priority(config.max_num_batched_tokens)
        room = _room(scheduler)
        output = scheduler.schedule()
        _check_prefill_held(scheduler, output, room, held)
        keys = [(r.priority, r.arrival_seq) for r in scheduler.running]
        assert keys == sorted(keys) if w["policy"] == "priority" else [k[1] for k in keys] == sorted(k[1] for k in keys)
        assert output.num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        assert len({s.request_id for s in output.scheduled}) == len(output.scheduled)
        adapters = {scheduler.requests[s.request_id].lora_id for s in output.scheduled} - {0}
        assert len(adapters) <= config.max_loras
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


@pytest.mark.parametrize("threshold", [8, 2.5])
def test_long_prompt_held_beside_a_decode_and_not_alone(threshold):
    """A long prompt beside a decoding request takes the most tokens its room allows (a fraction of
    a token-equivalent counts), each step's room the threshold's share of the decoder's token and
    its attention as the step begins; alone, it takes the whole budget."""
    kv = KVCacheManager(64, 16)
    config = SchedulerConfig(4, 512, 1024, long_prefill_token_threshold=threshold, attention_keys_per_token=64.0)
    scheduler = Scheduler(config, kv)
    decoder = Request("decoder", [1] * 20, SamplingParams(max_tokens=500), 500)
    scheduler.add_request(decoder)
    output = scheduler.schedule()
    assert [s.num_new_tokens for s in output.scheduled] == [20]  # nothing decodes yet: no hold
    scheduler.update(output, ModelRunnerOutput({"decoder": [5]}))
    long = Request("long", [1] * 400, SamplingParams(max_tokens=1), 1)
    scheduler.add_request(long)
    chunks = []
    while not long.status.finished:
        room = threshold * (1 + decoder.num_computed_tokens / 64)  # the decoder's context as the step begins
        output = scheduler.schedule()
        long_chunk = next(s for s in output.scheduled if s.request_id == "long")
        start, count = long_chunk.num_computed_tokens, long_chunk.num_new_tokens
        assert prompt_cost(start, count, 64.0) <= room or count == 1
        if start + count < 400:  # the most that fits: one more token would not
            assert prompt_cost(start, count + 1, 64.0) > room
        chunks.append(count)
        scheduler.update(output, ModelRunnerOutput({s.request_id: [5] for s in output.scheduled if s.sample}))
    assert len(chunks) > 10 and min(chunks) >= 1  # held over many steps
    alone = Scheduler(config, KVCacheManager(64, 16))
    alone.add_request(Request("long", [1] * 400, SamplingParams(max_tokens=1), 1))
    assert [s.num_new_tokens for s in alone.schedule().scheduled] == [400]


def test_long_prompts_submitted_together_are_not_held():
    """A batch submitted at once has no stream to keep: its long prompts take the token budget even
    once the first of them decode."""
    config = SchedulerConfig(4, 300, 1024, long_prefill_token_threshold=1, attention_keys_per_token=64.0)
    scheduler = Scheduler(config, KVCacheManager(128, 16))
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", [10 + i] * 200, SamplingParams(max_tokens=50), 50))  # no shared blocks
    steps = []
    while any(r.num_output_tokens == 0 for r in scheduler.requests.values()):
        output = scheduler.schedule()
        steps.append(sorted(s.num_new_tokens for s in output.scheduled))
        scheduler.update(output, ModelRunnerOutput({s.request_id: [5] for s in output.scheduled if s.sample}))
    assert steps == [[100, 200], [1, 100, 199], [1, 1, 1]]
