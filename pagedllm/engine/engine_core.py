"""EngineCore: the scheduler, the KV cache manager and the executor behind plain messages.

    out = scheduler.schedule(); result = executor.execute_model(out); scheduler.update(out, result)

Requests come in as EngineCoreRequests and each step answers with EngineCoreOutputs (new token
ids, logprobs, finish reasons): no text, no RequestOutput. The frontend (LLMEngine, AsyncLLM) does
tokenizing, detokenizing, stop strings and the fan-in of parallel samples.

A constrained request (structured outputs) waits in the StructuredOutputManager until its grammar
is compiled, then joins the scheduler; each step the manager fills the mask of the constrained
requests that sample and advances their matchers over the tokens the step gave them. A grammar
that is complete ends its request (finish reason "stop").
"""

from __future__ import annotations

import dataclasses
import logging
import time

from pagedllm.core.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.snapshot import EngineSnapshot, StepLog, take_snapshot
from pagedllm.core.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.faults import FaultInjector
from pagedllm.executor.abstract import Executor, ExecutorFailure
from pagedllm.spec_decode.adaptive import SpeculationController
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.structured_output.backend import InvalidConstraintError

logger = logging.getLogger(__name__)
# With nothing to run but grammars compiling, a step waits this long for one (then the caller takes
# its messages: new requests, aborts).
GRAMMAR_WAIT_S = 0.05


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        faults: FaultInjector | None = None,
        structured_output: StructuredOutputManager | None = None,
        proposer: NgramProposer | None = None,
        draft_tokens: int = 0,
    ) -> None:
        self.scheduler, self.executor = scheduler, executor
        self.proposer = proposer  # speculative decoding's drafts (n-gram), or None
        # Draft-model speculation: up to this many drafts a request, proposed by the worker after
        # each step (ModelRunnerOutput.spec_token_ids), kept here until the next step's schedule.
        self.draft_tokens = draft_tokens
        self._worker_drafts: dict[str, list[int]] = {}
        max_k = proposer.k if proposer is not None else draft_tokens
        # How many drafts each request gets (where they pay, measured); None (tests set it so): always up to k.
        self.controller = SpeculationController(max_k) if max_k else None
        self.faults = faults or FaultInjector()
        self.structured_output = structured_output
        self._failed: list[EngineCoreOutput] = []  # requests ended between steps: sent with the next
        self.step_log = StepLog()  # the last steps, for the dashboard

    # -- requests in and out ---------------------------------------------------------------------
    def add_request(self, message: EngineCoreRequest) -> None:
        request = Request(
            message.request_id,
            message.prompt_token_ids,
            message.sampling_params,
            message.max_tokens,
            message.eos_token_ids,
            arrival_time=message.arrival_time,
            cache_salt=message.cache_salt,
            hold=message.hold,
            pooling_params=message.pooling_params,
            mm_features=message.mm_features,
            lora_request=message.lora_request,
            priority=message.priority,
        )
        constraint = message.sampling_params.structured_outputs
        if constraint is None:
            self.scheduler.add_request(request, message.fork_of)
            return
        if self.structured_output is None:
            raise ValueError("this engine has no structured output backend")
        if message.request_id in self.scheduler.requests or self.structured_output.is_pending(message.request_id):
            raise ValueError(f"request id {message.request_id!r} is already in the engine core")
        self.structured_output.submit(message.request_id, constraint, (request, message.fork_of))
        self._admit_constrained()  # at once if its grammar is cached (a fork must find its parent held)

    def _admit_constrained(self) -> None:
        """Constrained requests whose grammar is ready join the scheduler; those whose grammar failed end."""
        if self.structured_output is None or not self.structured_output.num_pending:
            return
        ready, failed = self.structured_output.take_ready()
        for request, fork_of in ready:
            self.scheduler.add_request(request, fork_of)
        for request_id, (_, reason) in failed.items():
            self._failed.append(EngineCoreOutput(request_id, finish_reason="error", error=reason))

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests from outside (abort, a stop string the frontend found) or release held ones;
        unknown ids are ignored."""
        for request_id in request_ids:
            if self.structured_output is not None and self.structured_output.remove(request_id) is not None:
                continue  # it was still waiting for its grammar
            self.scheduler.finish_request(request_id, status)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._failed)
            or (self.structured_output is not None and self.structured_output.num_pending > 0)
        )

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if self.structured_output is not None and self.structured_output.num_pending:
            stats = dataclasses.replace(stats, num_waiting=stats.num_waiting + self.structured_output.num_pending)
        return stats

    def snapshot(self) -> EngineSnapshot:
        """The block pool, the queues and the last steps, for the dashboard (between steps)."""
        return take_snapshot(self.scheduler, self.stats(), self.step_log, time.time())

    def shutdown(self) -> None:
        if self.structured_output is not None:
            self.structured_output.shutdown()
        self.executor.shutdown()

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """One step. A failure in the executor ends only the requests it can be pinned on (their
        outputs carry the error); any other exception means the core's state is in doubt: the
        caller's engine cannot go on."""
        self._admit_constrained()
        ended, self._failed = self._failed, []
        self._propose()
        begin, preemptions = time.perf_counter(), self.scheduler.num_preemptions
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if self.scheduler.has_unfinished_requests():  # held blocks give way: this is a bug
                raise RuntimeError("no request can be scheduled though some are waiting")
            if self.structured_output is not None and not ended:
                self.structured_output.wait(GRAMMAR_WAIT_S)
            return ended
        if self.structured_output is not None:
            scheduler_output.token_bitmask = self.structured_output.bitmask(scheduler_output.scheduled)
        if self.draft_tokens:
            scheduler_output.num_draft_tokens = self._draft_lengths(scheduler_output)
        start = time.perf_counter()
        result, failures = self._execute(scheduler_output)
        if self.scheduler.tier is not None:
            self.scheduler.tier.observe_prefill(scheduler_output.num_scheduled_tokens, time.perf_counter() - start)
        if self.controller is not None:
            self._observe_speculation(scheduler_output, result, time.perf_counter() - start)
        self._worker_drafts = result.spec_token_ids
        failed = [self._fail(request_id, error) for request_id, error in failures.items()]
        self.faults.after_execute()
        updated = self.scheduler.update(scheduler_output, result)
        refused = self._advance_grammars(updated)
        self._log_step(scheduler_output, time.perf_counter() - begin, self.scheduler.num_preemptions - preemptions)
        return (
            [_output(r, result) for r in updated if r.request_id not in refused]
            + list(refused.values())
            + failed
            + ended
        )

    def _log_step(self, scheduler_output: SchedulerOutput, seconds: float, preemptions: int) -> None:
        decode = sum(
            r.num_new_tokens
            for r in scheduler_output.scheduled
            if r.sample and r.num_new_tokens == 1 + r.num_spec_tokens
        )
        self.step_log.add(
            time.time(),
            seconds,
            scheduler_output.num_scheduled_tokens - decode,
            decode,
            len(scheduler_output.scheduled),
            preemptions,
        )

    def _propose(self) -> None:
        """Draft tokens for each decoding request (the proposer's, up to what it may still
        generate but one). A constrained request's are cut where its grammar refuses one: each
        that is scheduled gets a mask row of its own (StructuredOutputManager.bitmask)."""
        if self.proposer is None and not self.draft_tokens:
            return
        decoding = [
            request
            for request in self.scheduler.running
            if request.num_tokens - request.num_computed_tokens == 1 and request.pooling_params is None
        ]
        # The draft model's proposals were cut to the controller's lengths when asked for (_draft_lengths).
        lengths = (
            None
            if self.controller is None or self.proposer is None
            else self.controller.draft_lengths([request.request_id for request in decoding])
        )
        for request in decoding:
            limit = request.max_tokens - request.num_output_tokens - 1
            if lengths is not None:
                limit = min(limit, lengths[request.request_id])
            if limit > 0:
                drafts = (
                    self.proposer.propose(request.all_token_ids, limit)
                    if self.proposer is not None
                    else self._worker_drafts.get(request.request_id, [])[:limit]
                )
                if (
                    drafts
                    and self.structured_output is not None
                    and self.structured_output.is_constrained(request.request_id)
                ):
                    drafts = self.structured_output.valid_drafts(request.request_id, drafts)
                request.spec_token_ids = drafts

    def _draft_lengths(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        """How many drafts the worker's draft model proposes after this step for each request that
        samples in it: the controller's choice (seeded requests always up to k, so that their
        draws do not hang on the machine's timing), within what the request may still generate."""
        sampling = [
            self.scheduler.requests[r.request_id]
            for r in scheduler_output.scheduled
            if r.sample and r.request_id in self.scheduler.requests
        ]
        sampling = [request for request in sampling if request.pooling_params is None]
        lengths = (
            None
            if self.controller is None
            else self.controller.draft_lengths([request.request_id for request in sampling])
        )
        chosen = {}
        for request in sampling:
            length = self.draft_tokens
            if lengths is not None and request.sampling_params.seed is None:
                length = lengths[request.request_id]
            # The step gives at least one token, the next one's verification one more.
            chosen[request.request_id] = max(0, min(length, request.max_tokens - request.num_output_tokens - 2))
        return chosen

    def _observe_speculation(
        self, scheduler_output: SchedulerOutput, result: ModelRunnerOutput, seconds: float
    ) -> None:
        """The controller learns each request's acceptance, and the step's time where every
        request in it was decoding (a prompt chunk's step says nothing about a draft's cost)."""
        assert self.controller is not None
        scheduled = scheduler_output.scheduled
        drafted = {
            r.request_id: (r.num_spec_tokens, len(result.sampled_token_ids.get(r.request_id, [])) - 1)
            for r in scheduled
            if r.num_spec_tokens
        }
        decoding = all(r.sample and r.num_new_tokens == 1 + r.num_spec_tokens for r in scheduled)
        self.controller.observe_draft(*result.draft_token_cost)
        self.controller.observe(
            drafted, scheduler_output.num_scheduled_tokens if decoding else None, seconds - result.draft_seconds
        )
        self.controller.retain({request.request_id for request in self.scheduler.running})

    def _advance_grammars(self, updated: list[Request]) -> dict[str, EngineCoreOutput]:
        """Each constrained request's matcher takes the step's tokens; a complete grammar ends its
        request. Returns the error outputs of requests whose grammar refused a token (the mask
        should have prevented it: min_tokens barring the only token the grammar allows can)."""
        manager = self.structured_output
        refused: dict[str, EngineCoreOutput] = {}
        if manager is None or not manager.num_constrained:
            return refused
        for request in updated:
            request_id = request.request_id
            if not manager.is_constrained(request_id):
                continue
            if not manager.accept(request_id, request.output_token_ids[request.num_reported_tokens :]):
                refused[request_id] = self._fail(
                    request_id,
                    InvalidConstraintError(
                        "no token of this model's vocabulary can continue the structured output constraint here "
                        "(it needs a character the vocabulary cannot spell)"
                        if manager.is_dead_end(request_id)
                        else "the sampled token is outside the request's grammar (min_tokens can bar the only tokens "
                        "a complete grammar allows: its end)"
                    ),
                )
                continue
            if manager.is_terminated(request_id) and not request.status.finished:
                self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
            if request.status.finished:
                manager.remove(request_id)
        return refused

    def _execute(self, scheduler_output: SchedulerOutput) -> tuple[ModelRunnerOutput, dict[str, Exception]]:
        """The step's forward pass and sampling; if it raises, each request again on its own, so that
        one request's failure (a kernel error on its rows, a bad parameter that got through) ends
        that request and the others go on. Rerunning is safe: a request's K/V slots are written with
        the same values, the worker takes the same message in again to the same effect, and nothing
        is sampled until a run succeeds."""
        try:
            return self._run(scheduler_output), {}
        except ExecutorFailure:
            raise  # no request's fault: the engine stops
        except Exception as exc:  # noqa: BLE001 - pinned on requests below
            if len(scheduler_output.scheduled) == 1:
                return ModelRunnerOutput(), {scheduler_output.scheduled[0].request_id: exc}
            logger.warning(
                "a step of %d requests failed (%r): running them one at a time", len(scheduler_output.scheduled), exc
            )
        merged, failures = ModelRunnerOutput(), {}
        # Block copies, store reads and finished ids ride with the first run that succeeds (copies and
        # reads are idempotent until a forward pass writes into their targets).
        pending = dataclasses.replace(scheduler_output, scheduled=[])
        for scheduled in scheduler_output.scheduled:
            try:
                part = self._run(dataclasses.replace(pending, scheduled=[scheduled]))
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                failures[scheduled.request_id] = exc
                continue
            merged.merge(part)
            pending = dataclasses.replace(pending, finished_request_ids=set(), blocks_to_copy=[], kv_loads=[])
        return merged, failures

    def _run(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # Tests' injected faults, as if the executor raised.
        self.faults.in_execute(scheduler_output, self.scheduler.requests)
        return self.executor.execute_model(scheduler_output)

    def _fail(self, request_id: str, error: Exception) -> EngineCoreOutput:
        logger.error("request %s failed: %r", request_id, error)
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if self.structured_output is not None:
            self.structured_output.remove(request_id)
        return EngineCoreOutput(request_id, finish_reason="error", error=f"{type(error).__name__}: {error}")


def _output(request: Request, result: ModelRunnerOutput) -> EngineCoreOutput:
    """What the step brought a request: the output tokens not reported yet, their logprobs, and its
    finish reason if it has one."""
    new = request.output_token_ids[request.num_reported_tokens :]
    request.num_reported_tokens = request.num_output_tokens
    queue_time = None
    if request.first_scheduled_time is not None:
        queue_time = request.first_scheduled_time - request.arrival_time
    return EngineCoreOutput(
        request.request_id,
        new,
        result.logprobs.get(request.request_id) if new else None,
        result.prompt_logprobs.get(request.request_id),
        request.status.finish_reason,
        request.stop_reason,
        queue_time,
        pooled=result.pooler_output.get(request.request_id),
    )
