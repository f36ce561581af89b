"""The step messages and the worker's persistent batch (worker/input_batch.py): a request travels
whole once (when first scheduled, or resumed after preemption), then as deltas; whatever the steps
(prefill chunks, decodes, preemption, rejected drafts, aborts, stops found outside, a failed step
rerun request by request), the worker's copy of every request equals the scheduler's, and the
step's inputs built from it equal those built from the scheduler's own state."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.messages import EngineCoreRequest
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from pagedllm.engine.engine_core import EngineCore
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch, RequestState
from test_multi_token_steps import VOCAB, accept, model_sequence, propose
from test_scheduler_properties import MAX_MODEL_LEN, make_scheduler


def _step(scheduler: Scheduler, sampled: list[int], batch: InputBatch | None = None) -> SchedulerOutput:
    """One step; each request that samples gets `sampled`."""
    output = scheduler.schedule()
    result = ModelRunnerOutput({s.request_id: list(sampled) for s in output.scheduled if s.sample})
    if batch is not None:
        batch.update(output)
        batch.append_sampled(result.sampled_token_ids)
    scheduler.update(output, result)
    return output


def test_a_request_travels_whole_once_then_as_deltas():
    kv = KVCacheManager(5, 4, enable_prefix_caching=False)  # 20 slots: b is preempted when a grows
    scheduler = Scheduler(SchedulerConfig(4, 6, 20), kv)
    a = Request("a", list(range(1, 11)), SamplingParams(max_tokens=6), 6)
    b = Request("b", [11, 12, 13], SamplingParams(max_tokens=6), 6)
    scheduler.add_request(a)
    scheduler.add_request(b)
    outputs = [_step(scheduler, [20 + i]) for i in range(8)]
    messages = [{s.request_id: s for s in output.scheduled} for output in outputs]

    first = messages[0]["a"]  # a's first chunk: all of a
    assert first.new_request == NewRequestData(a.prompt_token_ids, [], a.sampling_params, frozenset())
    assert (first.num_computed_tokens, first.num_new_tokens) == (0, 6)
    assert (first.num_kept_blocks, first.new_block_ids) == (0, [0, 1])
    second = messages[1]["a"]  # its second chunk: the block the chunk added
    assert second.new_request is None and (second.num_computed_tokens, second.num_new_tokens) == (6, 4)
    assert (second.num_kept_blocks, second.new_block_ids) == (2, [2])
    decode = messages[2]["a"]  # a decode within its last block: no block news
    assert decode.new_request is None and (decode.num_kept_blocks, decode.new_block_ids) == (3, [])
    assert messages[1]["b"].new_request is not None  # b: whole when admitted, then deltas
    assert messages[2]["b"].new_request is None and messages[3]["b"].new_request is None

    # Step 4: a needs a fifth block, b is preempted (the worker drops it) and later comes back whole.
    assert outputs[4].preempted_request_ids == {"b"} and "b" not in messages[4]
    resumed = messages[7]["b"]
    assert outputs[7].finished_request_ids == {"a"}
    assert resumed.new_request == NewRequestData([11, 12, 13], [22, 23], b.sampling_params, frozenset())
    assert (resumed.num_computed_tokens, resumed.num_kept_blocks, resumed.new_block_ids) == (0, 0, [3, 4])


def test_a_rollback_reaches_the_worker_as_a_smaller_count_and_table():
    kv = KVCacheManager(16, 2)
    scheduler = Scheduler(SchedulerConfig(4, 64, MAX_MODEL_LEN), kv)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=10), 10)
    scheduler.add_request(request)
    batch = InputBatch(2)
    _step(scheduler, [4], batch)
    request.spec_token_ids = [5, 6, 7]
    drafts = _step(scheduler, [9], batch)  # all three rejected: 4 tokens computed, 2 blocks again
    assert drafts.scheduled[0].spec_token_ids == [5, 6, 7] and len(kv.block_ids("r")) == 2
    state = batch.requests["r"]
    assert (state.num_computed_tokens, len(state.block_ids)) == (3, 4)  # the worker has not heard yet
    after = _step(scheduler, [8], batch).scheduled[0]
    assert (after.num_computed_tokens, after.num_kept_blocks, len(after.new_block_ids)) == (4, 2, 1)
    assert (state.num_computed_tokens, state.block_ids) == (4, kv.block_ids("r")[:3])
    assert state.all_token_ids == [1, 2, 3, 4, 9, 8] == request.all_token_ids


def test_a_block_copied_on_write_reaches_a_worker_that_holds_the_table():
    kv = KVCacheManager(8, 4)
    parent = Request("p", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=4), 4)
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    assert kv.take_new_block_ids("p", whole=True) == (0, kv.block_ids("p"))  # the worker holds it all
    child = Request("c", parent.prompt_token_ids, parent.sampling_params, 4, num_computed_tokens=6)
    kv.fork(parent, child)  # the partly filled second block is shared now
    assert kv.allocate_slots(parent, 1)  # the parent writes into it: its own copy
    assert kv.take_new_block_ids("p") == (1, kv.block_ids("p")[1:])
    assert kv.block_ids("p")[1] != kv.block_ids("c")[1] and kv.block_ids("p")[0] == kv.block_ids("c")[0]


def _reference_inputs(scheduler: Scheduler, scheduled: list[ScheduledRequest]) -> tuple[list[int], ...]:
    """Input ids, positions and slots as the runner built them before it kept a batch: position by
    position, from the scheduler's own tokens and tables."""
    bs = scheduler.kv.block_size
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for s in scheduled:
        blocks = scheduler.kv.block_ids(s.request_id)
        span = range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens)
        tokens += scheduler.requests[s.request_id].all_token_ids[span.start : span.stop] + s.spec_token_ids
        positions += span
        slots += [blocks[p // bs] * bs + p % bs for p in span]
    return tokens, positions, slots


class FakeWorker:
    """The engine core's executor: the real InputBatch under a fake model that reads only the
    worker's copy of each request. Checks that copy at every run, and fails on cue."""

    def __init__(self, scheduler: Scheduler, max_list_table_entries: int) -> None:
        self.scheduler = scheduler
        self.batch = InputBatch(scheduler.kv.block_size, rows=1, width=1, max_list_table_entries=max_list_table_entries)
        self.culprit: str | None = None  # every run holding this request raises ("batch": one of many, once)
        self.failed: set[str] = set()  # requests the engine ended for a failure
        # What the checks found (raised here, the engine core would take it for a request's failure).
        self.broken: list[AssertionError] = []

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        states = self.batch.update(output)
        try:
            self._check(output, states)
        except AssertionError as error:
            self.broken.append(error)
        ids = [s.request_id for s in output.scheduled]
        if self.culprit in ids or (self.culprit == "batch" and len(ids) > 1):
            if ids == [self.culprit]:
                self.failed.add(self.culprit)
            if self.culprit == "batch":
                self.culprit = None
            raise RuntimeError("a failure on cue")
        result = ModelRunnerOutput(
            {
                s.request_id: accept(state.all_token_ids, s.spec_token_ids)
                for s, state in zip(output.scheduled, states)
                if s.sample
            }
        )
        self.batch.append_sampled(result.sampled_token_ids)
        return result

    def _check(self, output: SchedulerOutput, states: list[RequestState]) -> None:
        scheduler = self.scheduler
        running = {r.request_id for r in scheduler.running}
        assert running <= set(self.batch.requests) <= running | self.failed  # dropped what ended
        rows = sorted([state.row for state in self.batch.requests.values()] + self.batch._free_rows)
        assert rows == list(range(self.batch.block_table.shape[0]))  # each row held once, or free
        for s, state in zip(output.scheduled, states):
            request = scheduler.requests[s.request_id]
            assert state.all_token_ids == request.all_token_ids
            assert state.block_ids == scheduler.kv.block_ids(s.request_id)
            assert state.num_computed_tokens == request.num_computed_tokens - s.num_new_tokens  # before the step
        input_ids, positions, meta = self.batch.prepare(output.scheduled, states)
        assert (input_ids.tolist(), positions.tolist(), meta.slot_mapping.tolist()) == _reference_inputs(
            scheduler, output.scheduled
        )
        ends = [s.num_computed_tokens + s.num_new_tokens for s in output.scheduled]
        assert meta.seq_lens.tolist() == meta.seq_lens_list == ends
        assert meta.query_start_loc.tolist()[1:] == [sum(meta.query_lens_list[: i + 1]) for i in range(len(ends))]
        for row, s in zip(meta.block_tables.tolist(), output.scheduled):
            table = scheduler.kv.block_ids(s.request_id)
            assert row[: len(table)] == table


workload_st = st.fixed_dictionaries(
    {
        # (prompt, max_tokens, arrival step); a small vocabulary, so that prompts share cached prefixes
        "requests": st.lists(
            st.tuples(
                st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=30), st.integers(0, 20), st.integers(0, 10)
            ),
            min_size=1,
            max_size=8,
        ),
        "block_size": st.sampled_from([1, 2, 4, 16]),
        "spare_blocks": st.integers(0, 12),  # few: preemption
        "budget": st.integers(1, 40),  # small: prefill chunks
        "max_num_seqs": st.integers(1, 5),
        "k": st.integers(0, 4),  # drafts per proposal
        "right": st.lists(st.integers(0, 4), min_size=1, max_size=20),  # leading drafts right, in turn
        "ends": st.lists(st.tuples(st.integers(0, 7), st.integers(0, 40), st.booleans()), max_size=3),  # abort?
        "failures": st.dictionaries(st.integers(0, 40), st.one_of(st.just("batch"), st.integers(0, 7)), max_size=3),
        "max_list_table_entries": st.sampled_from([0, 8, 512]),  # block tables from the array, either, from lists
    }
)


@settings(max_examples=150, deadline=None)
@given(workload_st)
def test_the_workers_copy_follows_the_scheduler(w):
    _, _, scheduler = make_scheduler(w)
    worker = FakeWorker(scheduler, w["max_list_table_entries"])
    core = EngineCore(scheduler, worker)
    pending = sorted(enumerate(w["requests"]), key=lambda x: x[1][2])
    ends = {step: (f"r{i}", abort) for i, step, abort in w["ends"]}
    requests: dict[str, Request] = {}
    proposals = 0
    for step in range(3000):
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _) = pending.pop(0)
            max_tokens = min(max_tokens, MAX_MODEL_LEN - len(prompt))
            message = EngineCoreRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens)
            core.add_request(message)
            requests[message.request_id] = scheduler.requests[message.request_id]
        if step in ends:  # an abort, or a stop string the frontend found
            request_id, abort = ends[step]
            core.finish_requests(
                [request_id], RequestStatus.FINISHED_ABORTED if abort else RequestStatus.FINISHED_STOPPED
            )
        if not pending and not core.has_unfinished_requests():
            break
        for request in scheduler.running:
            request.spec_token_ids = propose(request.all_token_ids, w["k"], w["right"][proposals % len(w["right"])])
            proposals += 1
        failure = w["failures"].get(step)
        worker.culprit = failure if failure in (None, "batch") else f"r{failure}"
        core.step()
        assert not worker.broken, worker.broken[0]
    else:
        raise AssertionError("requests never finished")
    for request in requests.values():  # the fake model read the worker's copy: any slip shows here
        assert request.status.finished
        expected = model_sequence(request.prompt_token_ids, request.max_tokens)
        assert request.output_token_ids == expected[: request.num_output_tokens]
        assert request.status != RequestStatus.FINISHED_LENGTH or request.num_output_tokens == request.max_tokens
