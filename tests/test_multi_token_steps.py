"""Multi-token steps on the core alone (issue 20): draft tokens scheduled and verified, accepted
ones kept, rejected ones rolled back with their slots and the blocks only they filled. Whatever the
drafts, each request's output equals the fake model's own sequence (what greedy speculative
decoding promises), budgets hold, and no block leaks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from test_scheduler_properties import MAX_MODEL_LEN, _check_blocks, make_scheduler

VOCAB = 7
EOS = 0


def model_token(tokens: list[int]) -> int:
    """The fake model's greedy next token after `tokens` (never EOS: lengths stay predictable)."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) % (VOCAB - 1)) + 1


def model_sequence(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(model_token(tokens))
    return tokens[len(prompt) :]


def accept(context: list[int], drafts: list[int]) -> list[int]:
    """The runner's side: the drafts while they are what the model would say, then one of its own."""
    context, tokens = list(context), []
    for draft in drafts:
        if draft != model_token(context):
            break
        tokens.append(draft)
        context.append(draft)
    return tokens + [model_token(context)]


def verify(output: SchedulerOutput, requests: dict[str, Request]) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        {
            s.request_id: accept(requests[s.request_id].all_token_ids, s.spec_token_ids)
            for s in output.scheduled
            if s.sample
        }
    )


def propose(context: list[int], k: int, right: int) -> list[int]:
    """k drafts after `context`, the first `right` of them what the model would say."""
    context, drafts = list(context), []
    for j in range(k):
        drafts.append(model_token(context) if j < right else model_token(context) % (VOCAB - 1) + 1)
        context.append(drafts[-1])
    return drafts


workload_st = st.fixed_dictionaries(
    {
        "requests": st.lists(
            st.tuples(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=30), st.integers(1, 24)),
            min_size=1,
            max_size=8,
        ),
        "block_size": st.sampled_from([1, 2, 4, 16]),
        "spare_blocks": st.integers(0, 12),
        "budget": st.integers(1, 40),
        "max_num_seqs": st.integers(1, 5),
        "k": st.integers(1, 5),
        # Per proposal, how many leading drafts are right (the rest are wrong), drawn in turn.
        "right": st.lists(st.integers(0, 5), min_size=1, max_size=50),
        "aborts": st.lists(st.tuples(st.integers(0, 7), st.integers(0, 40)), max_size=2),
    }
)


@settings(max_examples=200, deadline=None)
@given(workload_st)
def test_drafts_never_change_the_output_and_rollback_leaves_nothing_behind(w):
    bs = w["block_size"]
    kv, config, scheduler = make_scheduler(w)
    requests = {}
    for i, (prompt, max_tokens) in enumerate(w["requests"]):
        max_tokens = min(max_tokens, MAX_MODEL_LEN - len(prompt))
        requests[f"r{i}"] = Request(
            f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens, frozenset({EOS})
        )
        scheduler.add_request(requests[f"r{i}"])
    aborts = {step: f"r{i}" for i, step in w["aborts"]}
    proposals = 0
    for step in range(3000):
        if step in aborts:
            scheduler.finish_request(aborts[step], RequestStatus.FINISHED_ABORTED)
        if not scheduler.has_unfinished_requests():
            break
        for request in scheduler.running:  # a proposal replaces one the budget left unscheduled
            request.spec_token_ids = propose(request.all_token_ids, w["k"], w["right"][proposals % len(w["right"])])
            proposals += 1
        output = scheduler.schedule()
        assert output.num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        for s in output.scheduled:
            assert s.num_spec_tokens <= w["k"]
            assert len(kv.req_blocks[s.request_id]) * bs >= s.num_computed_tokens + s.num_new_tokens
        scheduler.update(output, verify(output, requests))
        _check_blocks(kv, scheduler)  # tables cover exactly the computed tokens: rejected slots are gone
        for request in scheduler.running:
            assert request.num_computed_tokens <= request.num_tokens
            hashes = request.block_hashes[: kv._num_cached.get(request.request_id, 0)]
            for index, block in enumerate(kv.req_blocks[request.request_id][: len(hashes)]):
                # Only accepted tokens were ever hashed (a block whose content another block already
                # caches stays unhashed).
                assert block.block_hash in (None, hashes[index])
    else:
        raise AssertionError("requests never finished")
    for request in requests.values():
        if request.status == RequestStatus.FINISHED_ABORTED:
            continue
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == model_sequence(request.prompt_token_ids, request.max_tokens)
    assert kv.num_free_blocks == kv.pool.num_blocks and not kv.req_blocks


def test_a_stop_among_accepted_drafts_drops_the_tokens_after_it():
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(SchedulerConfig(4, 64, MAX_MODEL_LEN), kv)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[5]), 10, frozenset({EOS}))
    scheduler.add_request(request)
    scheduler.update(scheduler.schedule(), ModelRunnerOutput({"r": [4]}))
    request.spec_token_ids = [6, 5, 6]
    output = scheduler.schedule()
    assert output.scheduled[0].num_new_tokens == 4 and output.scheduled[0].spec_token_ids == [6, 5, 6]
    scheduler.update(output, ModelRunnerOutput({"r": [6, 5, 6, 2]}))
    assert request.output_token_ids == [4, 6, 5] and request.status == RequestStatus.FINISHED_STOPPED
    assert kv.num_free_blocks == kv.pool.num_blocks
