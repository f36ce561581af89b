"""Property tests of KV sharing in the pure-Python core, against a simulated KV cache.

A fake model runner writes each token id into the slot the block tables give it (doing the
copies the scheduler asks for first). Then whatever a request attends to must be its own tokens:
that checks prefix hits, forks and copy-on-write at once, and with a sliding window, that the
blocks freed behind it were never still needed; with two groups of layers (a sliding one and a
full one sharing the pool, HybridKVCacheManager), each group's tables alike. The managers run in
debug mode, so a write into a shared or cached block fails loudly.
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import FREED, KVCacheManager, cdiv
from pagedllm.core.messages import TokenLogprobs
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch

MAX_MODEL_LEN = 64


def managers(kv: KVCacheManager | HybridKVCacheManager) -> list[KVCacheManager]:
    return kv.groups if isinstance(kv, HybridKVCacheManager) else [kv]


class FakeRunner:
    def __init__(self, kv: KVCacheManager | HybridKVCacheManager, seed: int) -> None:
        # slot -> (group, token id) written there: a group's layers hold their own K/V, so a table
        # that reads another group's block reads the wrong values even where the tokens agree.
        self.slots: dict[int, tuple[int, int]] = {}
        self.bs = kv.block_size
        self.windows = [group.sliding_window for group in managers(kv)]
        self.seed = seed
        self.logprobs: dict[str, TokenLogprobs] = {}  # request id -> its last sample's
        self.batch = InputBatch(kv.block_size)  # the worker's copy of the requests, from the step messages

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for src, dst in output.blocks_to_copy:
            for offset in range(self.bs):
                if src * self.bs + offset in self.slots:
                    self.slots[dst * self.bs + offset] = self.slots[src * self.bs + offset]
        result = ModelRunnerOutput()
        for r, state in zip(output.scheduled, self.batch.update(output)):
            end = r.num_computed_tokens + r.num_new_tokens
            for g, (window, blocks) in enumerate(zip(self.windows, [state.block_ids, *state.other_block_ids])):
                for pos in range(r.num_computed_tokens, end):
                    self.slots[blocks[pos // self.bs] * self.bs + pos % self.bs] = (g, state.all_token_ids[pos])
                # Attention reads positions [0, end), or from the first query's window on: they must
                # hold exactly this request's tokens, written by this group.
                first = max(r.num_computed_tokens - window + 1, 0) if window else 0
                seen = [self.slots.get(blocks[p // self.bs] * self.bs + p % self.bs) for p in range(first, end)]
                assert seen == [(g, t) for t in state.all_token_ids[first:end]], f"{r.request_id} reads foreign KV"
            if r.sample:
                token = (sum(state.all_token_ids) * 31 + len(r.request_id) + self.seed) % 50 + 3
                result.sampled_token_ids[r.request_id] = [token]
                result.logprobs[r.request_id] = [
                    TokenLogprobs([token, token, token + 1, token + 2], [-0.1, -0.1, -1.0, -2.0], [1, 1, 2, 3])
                ]
                self.logprobs[r.request_id] = result.logprobs[r.request_id][0]
        self.batch.append_sampled(result.sampled_token_ids)
        return result


def _check_pool(kv: KVCacheManager | HybridKVCacheManager, scheduler: Scheduler, runner: FakeRunner) -> None:
    holders: dict[int, int] = {}
    for blocks in (b for group in managers(kv) for b in group.req_blocks.values()):
        for block in blocks:
            if block is not FREED:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
    for block in kv.pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0)
        assert kv.pool.is_free(block) == (block.ref_cnt == 0)
        if block.block_hash is not None:
            assert kv.pool.cached[block.block_hash] is block
    for request in list(scheduler.running) + list(scheduler.held.values()):
        # A cached block holds exactly the tokens its hash was made from.
        bs = kv.block_size
        for g, group in enumerate(managers(kv)):
            table = group.req_blocks.get(request.request_id, [])
            for i, (block, block_hash) in enumerate(zip(table, request.block_hashes)):
                if block.block_hash == group._pool_hash(block_hash):
                    held = [runner.slots.get(block.block_id * bs + o) for o in range(bs)]
                    assert held == [(g, t) for t in request.all_token_ids[i * bs : (i + 1) * bs]]


def _check_prefix_computed_once(kv: KVCacheManager, scheduler: Scheduler, output: SchedulerOutput) -> None:
    """No full prompt block (by content hash) is computed by two requests in the same step, but for
    the block of a request's last prompt token: it computes that token whatever is cached, for its
    logits (parallel samples each into their own copy of the held prompt's block)."""
    written: set[int] = set()
    for s in output.scheduled:
        request = scheduler.requests[s.request_id]
        num_full = (request.num_prompt_tokens - 1) // kv.block_size
        end = min(s.num_computed_tokens + s.num_new_tokens, request.num_prompt_tokens)
        for index, block_hash in enumerate(managers(kv)[0]._block_hashes(request, num_full)):
            if s.num_computed_tokens < (index + 1) * kv.block_size and index * kv.block_size < end:
                assert block_hash not in written, f"{s.request_id} recomputes a block another request computes now"
                written.add(block_hash)


workload = st.fixed_dictionaries(
    {
        "requests": st.lists(
            st.fixed_dictionaries(
                {
                    "prefix": st.sampled_from([0, 3, 8, 20]),  # tokens shared with the common prefix
                    "own": st.integers(1, 15),
                    "max_tokens": st.integers(1, 12),
                    "n": st.sampled_from([1, 1, 2, 4]),
                    "beam": st.booleans(),
                    "arrival": st.integers(0, 8),
                    "abort_at": st.one_of(st.none(), st.integers(0, 20)),
                }
            ),
            min_size=1,
            max_size=8,
        ),
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "spare": st.integers(0, 30),
        "budget": st.integers(4, 40),
        "caching": st.booleans(),
        "seed": st.integers(0, 5),
        "window": st.sampled_from([None, None, 1, 3, 8, 17]),
        "hybrid": st.booleans(),  # a sliding group (the window, else 5) and a full group sharing the pool
    }
)


# Found by the search: in the hybrid manager, one group's new blocks evicted a cached block that
# another group had planned to revive as a prefix hit, and both groups' tables then held it.
_EVICTED_HIT = {
    "block_size": 1,
    "budget": 13,
    "caching": True,
    "hybrid": True,
    "requests": [
        {"abort_at": None, "arrival": 0, "beam": False, "max_tokens": 1, "n": 1, "own": 1, "prefix": 0},
        {"abort_at": None, "arrival": 0, "beam": False, "max_tokens": 1, "n": 1, "own": 1, "prefix": 0},
        {"abort_at": None, "arrival": 0, "beam": False, "max_tokens": 1, "n": 1, "own": 1, "prefix": 0},
        {"abort_at": None, "arrival": 0, "beam": False, "max_tokens": 1, "n": 1, "own": 1, "prefix": 0},
        {"abort_at": None, "arrival": 3, "beam": False, "max_tokens": 5, "n": 4, "own": 3, "prefix": 0},
        {"abort_at": None, "arrival": 4, "beam": False, "max_tokens": 1, "n": 1, "own": 1, "prefix": 3},
        {"abort_at": None, "arrival": 3, "beam": False, "max_tokens": 2, "n": 4, "own": 1, "prefix": 20},
        {"abort_at": None, "arrival": 3, "beam": False, "max_tokens": 1, "n": 1, "own": 3, "prefix": 20},
    ],
    "seed": 0,
    "spare": 0,
    "window": None,
}


# Found by the search: a beam's fork held the prefix's first block without a hit on it in the
# sliding group (window 1), so a request with the same prefix admitted in the same step had no hit
# and would have computed a block the fork was computing (only its first block was checked).
_FORK_AHEAD = {
    "block_size": 8,
    "budget": 27,
    "caching": True,
    "hybrid": True,
    "seed": 0,
    "spare": 2,
    "window": 1,
    "requests": [{"abort_at": None, "arrival": 0, "beam": False, "max_tokens": 1, "n": 1, "own": 1, "prefix": 0}] * 4
    + [
        {"abort_at": None, "arrival": 1, "beam": True, "max_tokens": 4, "n": 1, "own": 1, "prefix": 0},
        {"abort_at": None, "arrival": 1, "beam": True, "max_tokens": 5, "n": 1, "own": 1, "prefix": 20},
        {"abort_at": None, "arrival": 1, "beam": True, "max_tokens": 4, "n": 1, "own": 1, "prefix": 8},
        {"abort_at": None, "arrival": 0, "beam": True, "max_tokens": 5, "n": 1, "own": 5, "prefix": 20},
    ],
}


@settings(max_examples=120, deadline=None)
@given(workload)
@example(_EVICTED_HIT)
@example(_FORK_AHEAD)
def test_sharing_never_leaks_and_reads_only_own_tokens(w):
    bs = w["block_size"]
    if w["hybrid"]:
        kv = HybridKVCacheManager(
            2 * cdiv(MAX_MODEL_LEN, bs) + w["spare"], bs, (w["window"] or 5, None), w["caching"], debug=True
        )
    else:
        kv = KVCacheManager(
            cdiv(MAX_MODEL_LEN, bs) + w["spare"],
            bs,
            enable_prefix_caching=w["caching"],
            debug=True,
            sliding_window=w["window"],
        )
    scheduler = Scheduler(SchedulerConfig(8, w["budget"], MAX_MODEL_LEN), kv)
    runner = FakeRunner(kv, w["seed"])
    common = list(range(100, 120))
    beams: dict[str, tuple[str, int]] = {}  # live beam request id -> (its group, beam tokens so far)
    samples: dict[str, list[Request]] = {}  # held prompt -> the parallel samples to fork from it
    pending = sorted(enumerate(w["requests"]), key=lambda x: x[1]["arrival"])
    ids = iter(range(10**6))
    for step in range(3000):
        while pending and pending[0][1]["arrival"] <= step:
            i, spec = pending.pop(0)
            prompt = common[: spec["prefix"]] + [200 + i] * spec["own"]
            params = SamplingParams(n=spec["n"], max_tokens=spec["max_tokens"], seed=i)
            if spec["beam"]:  # one held token a step
                scheduler.add_request(Request(f"r{i}", prompt, params, 1, hold=True))
                beams[f"r{i}"] = (f"r{i}", 1)
            elif spec["n"] > 1 and len(prompt) > 1:  # the prompt but its last token, held for the samples
                scheduler.add_request(Request(f"r{i}", prompt[:-1], params, 0, hold=True))
                samples[f"r{i}"] = [Request(f"{c}_r{i}", prompt, params, spec["max_tokens"]) for c in range(spec["n"])]
            else:
                scheduler.add_request(Request(f"r{i}", prompt, params, spec["max_tokens"]))
        for i, spec in enumerate(w["requests"]):
            if spec["abort_at"] == step:
                samples.pop(f"r{i}", None)
                for rid in [
                    r for r in list(scheduler.requests) if r.endswith(f"r{i}") or beams.get(r, ("",))[0] == f"r{i}"
                ]:
                    scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        for prompt_id in [p for p in samples if p in scheduler.held]:
            for sample in samples.pop(prompt_id):
                scheduler.add_request(sample, fork_of=prompt_id)
            scheduler.finish_request(prompt_id, RequestStatus.FINISHED_ABORTED)  # released
        if not scheduler.has_unfinished_requests():
            # Every beam is held: each group keeps two beams, forked from its first parents.
            groups: dict[str, list[str]] = {}
            for parent_id, (group, _) in beams.items():
                groups.setdefault(group, []).append(parent_id)
            parents_of, beams = beams, {}
            for group, parent_ids in groups.items():
                parents = [scheduler.held[p] for p in parent_ids if p in scheduler.held]
                pairs = [(p, t) for p in parents for t in runner.logprobs[p.request_id].token_ids[1:3]][:2]
                for parent, token in pairs:
                    depth = parents_of[parent.request_id][1]
                    if depth + 1 < parent.sampling_params.max_tokens:
                        child_id = f"b{next(ids)}"
                        scheduler.add_request(
                            Request(
                                child_id, parent.all_token_ids[:-1] + [token], parent.sampling_params, 1, hold=True
                            ),
                            fork_of=parent.request_id,
                        )
                        beams[child_id] = (group, depth + 1)
                for parent in parents:
                    scheduler.finish_request(parent.request_id, RequestStatus.FINISHED_ABORTED)
            if not scheduler.has_unfinished_requests() and not pending:
                break
            continue
        output = scheduler.schedule()
        assert output.num_scheduled_tokens <= w["budget"]
        for s in output.scheduled:  # nothing behind a window is held
            for group in managers(kv):
                if group.sliding_window:
                    behind = max(s.num_computed_tokens - group.sliding_window + 1, 0) // bs
                    assert all(b is FREED for b in group.req_blocks[s.request_id][:behind])
        if w["caching"]:
            _check_prefix_computed_once(kv, scheduler, output)
        scheduler.update(output, runner.execute(output))
        _check_pool(kv, scheduler, runner)
    else:
        raise AssertionError("the workload never finished")
    assert not scheduler.held and not any(group.req_blocks for group in managers(kv))
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
