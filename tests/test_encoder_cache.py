"""Images in the core: the encoder cache's books and the scheduler's encoder steps (property tests
against a worker that mirrors the cache), and images in block hashes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv, extend_block_hashes
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step import ModelRunnerOutput
from pagedllm.multimodal import MultiModalFeature, content_identifier
from pagedllm.sampling_params import SamplingParams

IMAGE_TOKEN, EOS, MAX_MODEL_LEN = 7, 0, 96

# A prompt: runs of text and images (an image: which of a few pictures, and its embeddings).
part_st = st.one_of(st.integers(1, 12), st.tuples(st.integers(0, 3), st.integers(1, 12)))
request_st = st.tuples(st.lists(part_st, min_size=1, max_size=5), st.integers(1, 8), st.integers(0, 6))
workload_st = st.fixed_dictionaries(
    {
        "requests": st.lists(request_st, min_size=1, max_size=10),
        "aborts": st.lists(st.tuples(st.integers(0, 9), st.integers(0, 30)), max_size=3),
        "block_size": st.sampled_from([1, 4, 16]),
        "spare_blocks": st.integers(0, 12),
        "budget": st.integers(1, 40),
        "max_num_seqs": st.integers(1, 5),
        "cache_slack": st.integers(0, 30),  # encoder cache rows past the largest image
        "encoder_slack": st.integers(0, 20),  # a step's encoder rows past the largest image
        "threshold": st.sampled_from([0, 0, 0.5, 2]),  # long_prefill_token_threshold: prompts held beside decodes
        "keys": st.sampled_from([0.0, 5.0]),
        "whole_images": st.booleans(),  # Gemma 3's: no step, and no run of prefix hits, ends inside an image
    }
)


def make_request(request_id: str, parts: list, max_tokens: int) -> Request:
    tokens: list[int] = []
    features = []
    for part in parts:
        if isinstance(part, int):
            tokens += [1] * part
        else:
            picture, length = part
            identifier = content_identifier(b"picture", bytes([picture]), length.to_bytes(2, "little"))
            features.append(MultiModalFeature("image", identifier, len(tokens), length))
            tokens += [IMAGE_TOKEN] * length
    return Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=max_tokens),
        max_tokens,
        frozenset({EOS}),
        mm_features=tuple(features),
    )


def _check_books(scheduler: Scheduler) -> None:
    cache = scheduler.encoder_cache
    assert cache.num_free >= 0 and cache.num_free + sum(cache.sizes.values()) == cache.capacity
    assert not set(cache.freeable) & set(cache.refs)
    assert set(cache.freeable) | set(cache.refs) == set(cache.sizes)
    live = set(scheduler.running) | set(scheduler.held.values())
    for holders in cache.refs.values():
        assert holders and holders <= {r.request_id for r in live}


@settings(max_examples=150, deadline=None)
@given(workload_st)
def test_the_worker_always_holds_the_images_a_step_reads_and_encodes_each_once_while_cached(w):
    requests = [make_request(f"r{i}", parts, max_tokens) for i, (parts, max_tokens, _) in enumerate(w["requests"])]
    largest = max((f.length for r in requests for f in r.mm_features), default=1)
    kv = KVCacheManager(cdiv(MAX_MODEL_LEN, w["block_size"]) + w["spare_blocks"], w["block_size"])
    config = SchedulerConfig(
        w["max_num_seqs"],
        max(w["budget"], largest) if w["whole_images"] else w["budget"],  # (as the builder requires)
        MAX_MODEL_LEN,
        encoder_cache_size=largest + w["cache_slack"],
        encoder_budget=largest + w["encoder_slack"],
        long_prefill_token_threshold=w["threshold"],
        attention_keys_per_token=w["keys"],
        whole_images=w["whole_images"],
    )
    scheduler = Scheduler(config, kv)
    worker: dict[int, int] = {}  # identifier -> rows: the worker's encoder cache
    arrivals = sorted(zip((a for _, _, a in w["requests"]), requests, strict=True), key=lambda x: x[0])
    aborts = {step: f"r{i}" for i, step in w["aborts"]}
    for step in range(3000):
        while arrivals and arrivals[0][0] <= step:
            scheduler.add_request(arrivals.pop(0)[1])
        if step in aborts:
            scheduler.finish_request(aborts[step], RequestStatus.FINISHED_ABORTED)
        if not arrivals and not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        for identifier in output.evicted_encoder_ids:
            del worker[identifier]  # KeyError: evicted what the worker never had
        encoded = 0
        for scheduled in output.scheduled:
            request = scheduler.requests[scheduled.request_id]
            for index in scheduled.encoder_inputs:
                feature = request.mm_features[index]
                assert feature.identifier not in worker  # encoded again while cached
                worker[feature.identifier] = feature.length
                encoded += feature.length
            start, end = scheduled.num_computed_tokens, scheduled.num_computed_tokens + scheduled.num_new_tokens
            for feature in request.mm_features:
                if feature.overlaps(start, end):
                    assert worker.get(feature.identifier) == feature.length  # the step reads it
                if config.whole_images:
                    assert not feature.offset < start < feature.end and not feature.offset < end < feature.end
        assert encoded <= config.encoder_budget
        assert output.num_scheduled_tokens <= config.max_num_batched_tokens
        assert set(worker) == set(scheduler.encoder_cache.sizes)
        sampled = {
            s.request_id: [EOS if (step + len(s.request_id)) % 23 == 0 else 5] for s in output.scheduled if s.sample
        }
        scheduler.update(output, ModelRunnerOutput(sampled_token_ids=sampled))
        _check_books(scheduler)
    else:
        raise AssertionError("the requests never finished")
    assert not scheduler.encoder_cache.refs  # all released; cached entries stay, freeable


def test_a_repeated_image_is_a_hit_and_a_step_stops_before_an_image_it_cannot_encode():
    config = SchedulerConfig(4, 64, MAX_MODEL_LEN, encoder_cache_size=8, encoder_budget=8)
    scheduler = Scheduler(config, KVCacheManager(64, 4))
    first = make_request("a", [3, (0, 6), 2, (1, 6), 2], 2)
    scheduler.add_request(first)
    output = scheduler.schedule()
    (scheduled,) = output.scheduled
    # Both images do not fit a step's 8 encoder rows: it stops before the second.
    assert scheduled.encoder_inputs == [0] and scheduled.num_new_tokens == 3 + 6 + 2
    scheduler.update(output, ModelRunnerOutput())
    output = scheduler.schedule()
    (scheduled,) = output.scheduled
    assert scheduled.encoder_inputs == [1] and output.evicted_encoder_ids == [first.mm_features[0].identifier]
    scheduler.update(output, ModelRunnerOutput(sampled_token_ids={"a": [5]}))
    second = make_request("b", [1, (1, 6)], 1)
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert [s.encoder_inputs for s in output.scheduled if s.request_id == "b"] == [[]]  # cached: a hit
    assert scheduler.encoder_cache.num_hits == 1 and scheduler.encoder_cache.num_encoded == 2


def test_an_image_shown_again_later_does_not_hold_the_cache_against_the_one_between():
    # Room for one image: holding A for its second showing would leave B no room, ever.
    config = SchedulerConfig(4, 64, MAX_MODEL_LEN, encoder_cache_size=6, encoder_budget=6)
    scheduler = Scheduler(config, KVCacheManager(64, 4))
    scheduler.add_request(make_request("a", [(0, 6), 2, (1, 6), 2, (0, 6)], 1))
    encoded = []
    for _ in range(10):
        output = scheduler.schedule()
        if not output.scheduled:
            break
        (scheduled,) = output.scheduled
        encoded += scheduled.encoder_inputs
        sampled = {"a": [5]} if scheduled.sample else {}
        scheduler.update(output, ModelRunnerOutput(sampled_token_ids=sampled))
    assert not scheduler.has_unfinished_requests() and encoded == [0, 1, 2]  # A encoded again after B


def test_block_hashes_hold_the_image_content():
    tokens = [1, 2, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 3, 4]

    def hashes(*features: MultiModalFeature) -> list[int]:
        return extend_block_hashes([], tokens, 4, None, 2, features)

    one, other = content_identifier(b"one"), content_identifier(b"other")
    assert hashes(MultiModalFeature("image", one, 2, 4)) == hashes(MultiModalFeature("image", one, 2, 4))
    with_one, with_other = (
        hashes(MultiModalFeature("image", one, 2, 4)),
        hashes(MultiModalFeature("image", other, 2, 4)),
    )
    assert with_one[0] != with_other[0] and with_one[1] != with_other[1]
    assert hashes(MultiModalFeature("image", one, 2, 4)) != hashes()  # text alone hashes as before
    assert hashes() == extend_block_hashes([], tokens, 4, None, 2)
    assert content_identifier(b"ab", b"c") != content_identifier(b"a", b"bc")


def test_whole_images_prefix_hits_stop_before_every_image_they_would_cut():
    """Two images back to back, the second ending past the last cached block: cut back to the
    second image's block boundary, the hits would end inside the first; they stop before both."""
    config = SchedulerConfig(4, 64, MAX_MODEL_LEN, encoder_cache_size=13, encoder_budget=13, whole_images=True)
    scheduler = Scheduler(config, KVCacheManager(64, 4))
    scheduler.add_request(make_request("a", [(0, 10), (1, 3)], 3))  # still running: its blocks cached
    output = scheduler.schedule()
    scheduler.update(output, ModelRunnerOutput(sampled_token_ids={"a": [5]}))
    scheduler.add_request(make_request("b", [(0, 10), (1, 3)], 1))
    output = scheduler.schedule()
    (scheduled,) = [s for s in output.scheduled if s.request_id == "b"]
    assert scheduled.num_computed_tokens == 0 and scheduled.num_new_tokens == 13
