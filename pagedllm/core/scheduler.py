"""Scheduler: every step, which requests run and how many of their tokens, under the budgets.

Running requests go first (decodes and unfinished prefill chunks), then waiting ones are admitted
while the token budget, the sequence limit and the KV pool allow. A waiting request whose next
prompt block another running request is computing waits for it to be cached rather than
computing it again (many requests sharing a system prompt arrive together). When the pool runs
dry, the most recently arrived running request is preempted: its blocks are freed and it is
recomputed later.

Under the priority policy (`SchedulerConfig.policy`), both queues are ordered by (priority,
arrival), lower values first: the running requests get the step's budget in that order, the
victim of a dry pool is the lowest-priority newest one, and before anything is scheduled, running
requests of a strictly lower priority than the waiting head are preempted while the head would
not fit (no sequence slot, or too few free blocks for its first chunk). Equal priorities never
preempt each other: within one level it is arrival order.

A long prompt (longer than LONG_PROMPT_SHARE of max_model_len, vLLM's notion of long) that arrives
while others are generating does not stall them: while some decode, its tokens a step are held to
a share of what the decodes' own step costs (`long_prefill_token_threshold` times their tokens and
their attention over their contexts), a prompt token costing one token plus its attention over
the context before it, which grows with its position (`attention_keys_per_token`). The step's
first held prefill always gets a token. Short prompts, and long ones that arrived with no stream
to keep (a batch submitted at once), go under the token budget alone.

A request may ask to be held: once finished it keeps its blocks until the frontend releases it,
and new requests can fork from it (take references to its blocks for the tokens it computed and
go on from there). That is all the core knows of parallel samples and beam search, which the
frontend drives (engine/llm_engine.py, engine/beam_search.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Iterable

from pagedllm.config import SchedulerConfig
from pagedllm.core.encoder_cache_manager import EncoderCacheManager
from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import FREED, KVCacheManager
from pagedllm.core.kv_tier import KVTier
from pagedllm.core.messages import SchedulerStats
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import fcfs_key, make_waiting_queue, priority_key
from pagedllm.core.step import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput

LONG_PROMPT_SHARE = 0.04


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager | HybridKVCacheManager,
        tier: KVTier | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.tier = tier  # the KV cache's second tier (--kv-offload-dir), or None
        self.waiting = make_waiting_queue(config.policy)
        # Kept sorted by arrival (priority: by priority, then arrival), so the first victim is last.
        self.running: list[Request] = []
        self._key = priority_key if config.policy == "priority" else fcfs_key
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # finished, keeping their blocks for forks
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        # Requests the worker holds (sent whole once): their later steps carry only deltas.
        self._worker_ids: set[str] = set()
        # Long prompts that arrived while others were generating: their prefill is held (see above).
        self._held_prefills: set[str] = set()
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_size)
        self._step_encodes: dict[str, list[int]] = {}  # request id -> its images encoded this step
        self.num_preemptions = 0
        self.spec_counts = [0, 0, 0]  # drafts, draft tokens, accepted tokens (SchedulerStats.spec_*)
        self.spec_accepted_per_position: list[int] = []

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request, fork_of: str | None = None) -> None:
        """Queue a request. `fork_of`: a held request whose computed tokens begin this one's; the
        new request shares those blocks and computes only the rest (all of it if the parent is
        gone or gave its blocks up meanwhile)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine core")
        self._check_images(request)
        self.requests[request.request_id] = request
        if self._long(request) and any(r.num_output_tokens for r in self.running):
            self._held_prefills.add(request.request_id)
        parent = self.held.get(fork_of) if fork_of is not None else None
        if parent is None or not self._fork(parent, request):
            self.waiting.append(request)

    def _check_images(self, request: Request) -> None:
        """An image must fit the encoder cache and a step's encoder budget, or it would wait forever."""
        room = min(self.config.encoder_cache_size, self.config.encoder_budget)
        for feature in request.mm_features:
            if feature.length > room:
                what = f"an image of {feature.length} embeddings" if room else "images"
                raise ValueError(f"{request.request_id}: {what} exceed(s) the encoder's room of {room}")

    def _fork(self, parent: Request, child: Request) -> bool:
        computed = parent.num_computed_tokens
        if (
            computed == 0
            or computed >= child.num_tokens
            or child.cache_root != parent.cache_root
            or child.all_token_ids[:computed] != parent.all_token_ids[:computed]
            or [f.identifier for f in child.mm_features] != [f.identifier for f in parent.mm_features]
        ):
            return False
        self.kv.fork(parent, child)
        child.block_hashes = parent.block_hashes[: computed // self.kv.block_size]  # same tokens, same salt
        child.num_computed_tokens = computed
        child.status = RequestStatus.RUNNING
        child.first_scheduled_time = time.monotonic()
        bisect.insort(self.running, child, key=self._key)
        return True

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request from outside (abort, stop string) or release a held one; unknown or
        finished ids are ignored."""
        request = self.requests.get(request_id)
        if request is not None and self.held.pop(request_id, None) is not None:
            self._release(request)
            return
        if request is None or request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self._release(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        if self.config.policy == "priority":
            self._preempt_for_priority(budget)
        chosen: list[tuple[Request, int]] = []
        preempted = False
        room, chosen_prefill = self._prefill_room(), False
        encoder_budget = self.config.encoder_budget
        adapters: set[int] = set()  # the LoRA adapters of the requests chosen so far
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not self._adapter_fits(request, adapters):
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens + self._num_spec(request), budget)
            before = None  # (room, chosen_prefill) before a held prompt's chunk took its share
            if request.num_tokens - request.num_computed_tokens > 1 and request.request_id in self._held_prefills:
                before = room, chosen_prefill
                num_new, room = self._held_chunk(
                    request, request.num_computed_tokens, num_new, room, not chosen_prefill
                )
                chosen_prefill = True
                if num_new == 0:
                    i += 1
                    continue
            if request.mm_features:
                cut, encoder_budget = self._schedule_encoder(request, num_new, encoder_budget)
                if cut < num_new and before is not None:
                    room, chosen_prefill = self._refund(before, request.num_computed_tokens, cut)
                num_new = cut
                if num_new == 0:
                    i += 1
                    continue
            if self._allocate_or_preempt(request, num_new, self._lookahead(request, num_new)):
                chosen.append((request, num_new))
                budget -= num_new
                adapters.add(request.lora_id)
                i += 1
            else:
                preempted = True  # `request` itself was preempted; nothing after it is left
        # Admitting new work in the step that had to preempt would only preempt again.
        in_flight = {
            h
            for r in self.running
            if r.num_computed_tokens < r.num_prompt_tokens
            for h in self.kv.uncached_prompt_hashes(r)
        }
        deferred: list[Request] = []
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self._adapter_fits(request, adapters):
                deferred.append(self.waiting.popleft())
                continue
            computed = self.kv.get_computed_blocks(request)
            if self.tier is not None and self._start_tier_load(request, computed):
                deferred.append(self.waiting.popleft())  # admitted once its blocks are read
                continue
            if self.config.whole_images:
                del computed[self._blocks_before_image(request, len(computed)) :]
            num_cached = len(computed) * self.kv.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, budget)
            before = None
            if request.request_id in self._held_prefills:
                before = room, chosen_prefill
                num_new, room = self._held_chunk(
                    request, request.num_computed_tokens + num_cached, num_new, room, not chosen_prefill
                )
                if num_new == 0:
                    break
                chosen_prefill = True
            if request.mm_features:
                request.num_computed_tokens += num_cached  # (undone below unless it is admitted)
                cut, encoder_budget = self._schedule_encoder(request, num_new, encoder_budget)
                request.num_computed_tokens -= num_cached
                if cut < num_new and before is not None:
                    room, chosen_prefill = self._refund(before, request.num_computed_tokens + num_cached, cut)
                num_new = cut
                if num_new == 0:
                    break
            # A block another request computes now is a hit once its step is done. (Past the first
            # block too: a fork, or a group's blocks behind its window, can leave a request with
            # fewer hits than the other has blocks of the same prefix.)
            if in_flight and in_flight.intersection(self.kv.step_block_hashes(request, len(computed), num_new)):
                self._drop_encoder_refs(request)
                deferred.append(self.waiting.popleft())
                continue
            if not self.config.chunked_prefill and num_new < request.num_tokens - request.num_computed_tokens:
                break  # an encoder's prompt goes in one step: it waits for a step with room for all of it
            if not self.kv.allocate_slots(request, num_new + self._lookahead(request, num_cached + num_new), computed):
                self._drop_encoder_refs(request)
                if not self.running and self._drop_held_blocks():
                    continue  # nothing runs: held requests must make room, or no one moves
                break
            request.num_computed_tokens += num_cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            bisect.insort(self.running, request, key=self._key)
            chosen.append((request, num_new))
            budget -= num_new
            adapters.add(request.lora_id)
            in_flight.update(self.kv.uncached_prompt_hashes(request))
        if self.waiting and self.waiting[0].mm_features:
            self._drop_encoder_refs(self.waiting[0])  # it stopped the loop, perhaps with images booked
        self.waiting.extendleft(reversed(deferred))
        return self._build_output(chosen)

    def _start_tier_load(self, request: Request, computed: list) -> bool:
        """Whether the request waits for blocks of its prompt, past its memory hits, that the
        second tier holds (kv_tier.py): reading them now, or next step where there is no room
        now while other requests run or read (with none, it reads what fits or computes)."""
        if self.tier is None:
            return False
        candidates = self.kv.tier_candidates(request, len(computed))
        if not candidates:
            return False
        hits = [b for hit in computed for b in (hit if isinstance(hit, tuple) else (hit,)) if b is not FREED]
        reserve = len(self.running) * len(candidates[0])
        positions = -(-(request.num_tokens + self.config.num_lookahead_tokens) // self.kv.block_size)
        while candidates:
            answer = self.tier.start_load(
                request.request_id, candidates, self.kv.pool, hits, positions - len(computed), reserve
            )
            if answer != "wait":
                return answer == "started"
            if self.running or self.tier.loading:
                return True  # next step, when the others' blocks may be free
            candidates = candidates[: len(candidates) // 2]  # alone: read what fits
        return False

    def _preempt_for_priority(self, budget: int) -> None:
        """Preempt running requests of a strictly lower priority (the last first) while the waiting
        head could not be admitted: every sequence slot taken, or fewer free blocks than its first
        chunk and the running decodes' next tokens need."""
        while self.waiting and self.running and self.running[-1].priority > self.waiting[0].priority:
            if self._head_fits(self.waiting[0], budget):
                return
            self._preempt(self.running.pop())

    def _head_fits(self, head: Request, budget: int) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        size = self.kv.block_size
        chunk = min(head.num_tokens - head.num_computed_tokens, budget)
        # (Cache hits are not counted: that lookup is the admission's own, and counts in the stats.)
        needed = -(-chunk // size) + sum(1 for r in self.running if r.num_computed_tokens % size == 0)
        return self.kv.num_free_blocks >= needed

    def _adapter_fits(self, request: Request, adapters: set[int]) -> bool:
        """Whether the request may join a step whose chosen requests run `adapters` (0: the base
        model's): a step runs at most `max_loras` distinct adapters, as the worker has slots."""
        limit = self.config.max_loras
        return not limit or not request.lora_id or request.lora_id in adapters or len(adapters - {0}) < limit

    def _long(self, request: Request) -> bool:
        return request.num_prompt_tokens > LONG_PROMPT_SHARE * self.config.max_model_len

    def _prefill_room(self) -> float:
        """What this step's held prompts' tokens may cost, in token-equivalents (_chunk_cost):
        unbounded when no request decodes; else the threshold's share (fractions too) of what the
        decoding requests' own step costs, a token each plus their attention over their contexts:
        the step may grow by that share."""
        threshold, keys = self.config.long_prefill_token_threshold, self.config.attention_keys_per_token
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        if not threshold or not decoding:
            return float("inf")
        return threshold * (len(decoding) + (sum(r.num_computed_tokens for r in decoding) / keys if keys else 0.0))

    def _chunk_cost(self, start: int, count: int) -> float:
        """Token-equivalents of prompt tokens start..start+count: a token each plus their attention
        over the keys up to each (start + 1 ... start + count of them)."""
        keys = self.config.attention_keys_per_token
        attended = count * start + count * (count + 1) // 2
        return count + (attended / keys if keys else 0.0)

    def _chunk_within(self, start: int, num_new: int, room: float, first: bool) -> tuple[int, float]:
        """The most of `num_new` prompt tokens from `start` that fit `room`, and the room left. The
        step's first prefill gets a token even where one costs more than the room."""
        if room == float("inf"):
            return num_new, room
        low, high = 0, num_new  # bisect: the cost grows with the count
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self._chunk_cost(start, mid) <= room else (low, mid - 1)
        count = max(low, 1) if first else low
        return count, room - self._chunk_cost(start, count)

    def _schedule_encoder(self, request: Request, num_new: int, budget: int) -> tuple[int, int]:
        """The images the step's tokens reach (from num_computed_tokens): a cached one is
        referenced; another is encoded this step where the step's encoder budget and the cache
        have room, else the step stops before it (perhaps at once). The tokens and the budget left."""
        start = request.num_computed_tokens
        for index, feature in enumerate(request.mm_features):
            if not feature.overlaps(start, start + num_new):
                continue
            if self.config.whole_images and feature.end > start + num_new:
                return max(feature.offset - start, 0), budget
            if self.encoder_cache.lookup(request.request_id, feature):
                continue
            if feature.length > budget or not self.encoder_cache.can_allocate(feature):
                return max(feature.offset - start, 0), budget
            self.encoder_cache.allocate(request.request_id, feature)
            self._step_encodes.setdefault(request.request_id, []).append(index)
            budget -= feature.length
        return num_new, budget

    def _blocks_before_image(self, request: Request, num_hits: int) -> int:
        """How many of a request's first `num_hits` cached blocks it takes where no run of hits
        may end inside an image: those before the image their end would cut."""
        end = num_hits * self.kv.block_size
        # Last image first: the block boundary before one image may fall inside the image before it.
        for feature in reversed(request.mm_features):
            if feature.offset < end < feature.end:
                end = feature.offset // self.kv.block_size * self.kv.block_size
        return end // self.kv.block_size

    def _held_chunk(self, request: Request, start: int, num_new: int, room: float, first: bool) -> tuple[int, float]:
        """_chunk_within for a held prompt. Where images are whole, the step's first prefill, had it
        to end inside an image, goes on to the image's end if `num_new` reaches it (else it could
        never pass an image larger than the room: _schedule_encoder stops a chunk before it)."""
        count, left = self._chunk_within(start, num_new, room, first)
        if self.config.whole_images and first:
            for feature in request.mm_features:
                if feature.offset < start + count < feature.end <= start + num_new:
                    return feature.end - start, room - self._chunk_cost(start, feature.end - start)
        return count, left

    def _refund(self, before: tuple[float, bool], start: int, count: int) -> tuple[float, bool]:
        """The prefill room and whether a held prompt has taken its share, once the encoder cut a
        held prompt's chunk to `count` tokens: what it did not take goes back to the next one."""
        room, chosen = before
        return (room - self._chunk_cost(start, count), True) if count else (room, chosen)

    def _drop_encoder_refs(self, request: Request) -> None:
        """The request holds no images any more: those booked for a step it will not run go, the
        rest stay cached, unreferenced."""
        for index in self._step_encodes.pop(request.request_id, []):
            self.encoder_cache.cancel(request.mm_features[index])
        for feature in request.mm_features:
            self.encoder_cache.release(request.request_id, feature)

    def _release_encoded(self, request: Request) -> None:
        """Images whose placeholders are all computed are no longer the request's to hold, even if
        it shows one again further on (held, it could fill the cache and stop the request for
        good): that showing finds it still cached, or encodes it again."""
        done = request.num_computed_tokens
        for feature in request.mm_features:
            if feature.end <= done:
                self.encoder_cache.release(request.request_id, feature)

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Slots past the step's tokens for a request that samples in it (draft-model speculation)."""
        samples = request.num_computed_tokens + num_new >= request.num_tokens
        return self.config.num_lookahead_tokens if samples and request.pooling_params is None else 0

    def _allocate_or_preempt(self, request: Request, num_new: int, lookahead: int = 0) -> bool:
        """Allocate for `request` (and `lookahead` slots past), preempting the newest running
        requests until it fits."""
        while not self.kv.allocate_slots(request, num_new + lookahead):
            if self._drop_held_blocks():
                continue  # held requests compute nothing now: they give way first
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _drop_held_blocks(self) -> bool:
        """Free the newest held request's blocks (its forks will compute everything); False if none
        hold any."""
        holders = [r for r in self.held.values() if self.kv.req_blocks.get(r.request_id)]
        if not holders:
            return False
        request = max(holders, key=lambda r: r.arrival_seq)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        if self.tier is not None:
            self.tier.forget(request.request_id)  # it may read its blocks back when it resumes
        self._drop_encoder_refs(request)
        self._worker_ids.discard(request.request_id)
        self._preempted_ids.add(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    @staticmethod
    def _num_spec(request: Request) -> int:
        """Draft tokens to verify this step: only once every known token but the last is computed."""
        return len(request.spec_token_ids) if request.num_tokens - request.num_computed_tokens == 1 else 0

    def _build_output(self, chosen: list[tuple[Request, int]]) -> SchedulerOutput:
        loads = self.tier.step_loads() if self.tier is not None else []
        if not chosen and not loads:  # no step reaches the worker: the ids it should drop wait for one that does
            return SchedulerOutput([])
        scheduled = [self._schedule_request(request, num_new) for request, num_new in chosen]
        output = SchedulerOutput(scheduled, self._finished_ids, self._preempted_ids, self.kv.take_copies())
        output.kv_loads = loads
        output.evicted_encoder_ids = self.encoder_cache.take_evicted()
        self._finished_ids, self._preempted_ids = set(), set()
        return output

    def _schedule_request(self, request: Request, num_new: int) -> ScheduledRequest:
        """The step's message for one request: all of it if the worker does not hold it yet, else
        what changed since its last step."""
        start = request.num_computed_tokens
        new = request.request_id not in self._worker_ids
        self._worker_ids.add(request.request_id)
        num_kept, new_block_ids = self.kv.take_new_block_ids(request.request_id, whole=new)
        drafts = request.spec_token_ids[: max(start + num_new - request.num_tokens, 0)]  # the budget may cut them
        request.spec_token_ids = []  # proposed again for the next step
        request.num_computed_tokens += num_new
        return ScheduledRequest(
            request_id=request.request_id,
            num_computed_tokens=start,
            num_new_tokens=num_new,
            num_kept_blocks=num_kept,
            new_block_ids=new_block_ids,
            sample=start + num_new >= request.num_tokens,
            new_request=NewRequestData(
                request.prompt_token_ids,
                list(request.output_token_ids),
                request.sampling_params,
                request.eos_token_ids,
                request.pooling_params,
                request.mm_features,
                request.lora_request,
            )
            if new
            else None,
            spec_token_ids=drafts,
            other_group_blocks=self.kv.take_other_group_block_ids(request.request_id, whole=new),
            encoder_inputs=self._step_encodes.pop(request.request_id, []),
            kv_saves=self._kv_saves(request, min(start + num_new, request.num_tokens)),
        )

    def _kv_saves(self, request: Request, num_tokens: int) -> list[tuple[int, int]]:
        """The blocks a step completes (its known tokens: drafts may be rejected) that the second
        tier does not hold yet."""
        if self.tier is None:
            return []
        saves = [(h, b) for h, b in self.kv.blocks_to_save(request, num_tokens) if h not in self.tier.stored]
        self.tier.note_saves(h for h, _ in saves)
        return saves

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Append sampled tokens (rolling back rejected drafts) and finish requests that hit a stop;
        returns requests with news."""
        if self.tier is not None:
            self.tier.take_report(result.kv_store)
            self.tier.finish_loads(result.kv_store, self.kv.pool)
        touched = []
        for scheduled in output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or preempted since it was scheduled
            touched.append(request)
            if request.mm_features:
                self._release_encoded(request)
            if not scheduled.sample:
                self.kv.cache_full_blocks(request)
                continue  # a prefill chunk: nothing sampled yet
            if not self._accept(request, scheduled, result.sampled_token_ids.get(request.request_id, [])):
                self.kv.cache_full_blocks(request)  # after the accepted tokens joined all_token_ids
        return touched

    def _accept(self, request: Request, scheduled: ScheduledRequest, tokens: list[int]) -> bool:
        """Take a step's tokens: the drafts the runner accepted, then its own. Rejected drafts are
        rolled back (their slots, and the blocks only they filled). True if the request finished."""
        accepted_drafts = max(len(tokens) - 1, 0)
        rejected = scheduled.num_spec_tokens - accepted_drafts
        if rejected < 0:
            raise ValueError(f"{request.request_id}: {len(tokens)} tokens for {scheduled.num_spec_tokens} drafts")
        if scheduled.num_spec_tokens:
            for i, count in enumerate((1, scheduled.num_spec_tokens, accepted_drafts)):
                self.spec_counts[i] += count
            per_position = self.spec_accepted_per_position
            per_position += [0] * (scheduled.num_spec_tokens - len(per_position))
            for position in range(accepted_drafts):
                per_position[position] += 1
        if rejected:
            request.num_computed_tokens -= rejected
            self.kv.trim(request, self.config.num_lookahead_tokens)
        if request.max_tokens == 0:  # max_tokens=0 only scores the prompt
            tokens = []
        for token in tokens or (None,):
            if token is not None:
                request.append_output_token(token)
            if request.check_stop():  # tokens past a stop are dropped
                self._finish_running(request)
                return True
        return False

    def _finish_running(self, request: Request) -> None:
        self.running.remove(request)
        if not request.hold:
            self._release(request)
            return
        # Held: its blocks stay for forks, covering only its own tokens (drafts accepted past a stop
        # were computed, then dropped).
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
        self.kv.trim(request)
        self.kv.cache_full_blocks(request)
        self.held[request.request_id] = request
        self._worker_ids.discard(request.request_id)
        self._finished_ids.add(request.request_id)  # it runs no more: the worker's copy can go

    def _release(self, request: Request) -> None:
        self._held_prefills.discard(request.request_id)
        if self.tier is not None:
            self.tier.forget(request.request_id)
        self._drop_encoder_refs(request)
        self.kv.free(request)
        self._worker_ids.discard(request.request_id)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]

    def stats(self) -> SchedulerStats:
        total = self.kv.pool.num_blocks
        free = self.kv.num_free_blocks
        slots = self.kv.num_allocated_slots()
        held = sum(self.kv.num_stored_tokens(r) for r in self.running)
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_total=total,
            kv_blocks_free=free,
            kv_cache_usage=(total - free) / total,
            kv_waste=1.0 - held / slots if slots else 0.0,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            spec_num_drafts=self.spec_counts[0],
            spec_num_draft_tokens=self.spec_counts[1],
            spec_num_accepted_tokens=self.spec_counts[2],
            running_loras=_adapter_names(self.running),
            waiting_loras=_adapter_names(self.waiting),
            max_loras=self.config.max_loras,
            spec_accepted_per_position=tuple(self.spec_accepted_per_position),
            encoder_cache_size=self.encoder_cache.capacity,
            encoder_cache_used=self.encoder_cache.num_cached_rows,
            encoder_cache_entries=len(self.encoder_cache.sizes),
            encoder_cache_queries=self.encoder_cache.num_hits + self.encoder_cache.num_encoded,
            encoder_cache_hits=self.encoder_cache.num_hits,
        )
        return dataclasses.replace(stats, **self.tier.stats()) if self.tier is not None else stats


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))
