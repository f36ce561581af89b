"""EngineCore: the scheduler, the KV cache manager and the executor behind plain messages.

    out = scheduler.schedule(); result = executor.execute_model(out); scheduler.update(out, result)

Requests come in as EngineCoreRequests and each step answers with EngineCoreOutputs (new token
ids, logprobs, finish reasons): no tokenizer, no text, no RequestOutput. The frontend (LLMEngine,
AsyncLLM) does tokenizing, detokenizing, stop strings and the fan-in of parallel samples.
"""
from __future__ import annotations

import dataclasses
import logging

from pagedllm.core.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerStats
from pagedllm.core.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.faults import FaultInjector
from pagedllm.executor.abstract import Executor

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, faults: FaultInjector | None = None) -> None:
        self.scheduler, self.executor = scheduler, executor
        self.faults = faults or FaultInjector()

    # -- requests in and out ---------------------------------------------------------------------
    def add_request(self, message: EngineCoreRequest) -> None:
        request = Request(message.request_id, message.prompt_token_ids, message.sampling_params,
                          message.max_tokens, message.eos_token_ids, arrival_time=message.arrival_time,
                          cache_salt=message.cache_salt, hold=message.hold)
        self.scheduler.add_request(request, message.fork_of)

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests from outside (abort, a stop string the frontend found) or release held ones;
        unknown ids are ignored."""
        for request_id in request_ids:
            self.scheduler.finish_request(request_id, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        """Nothing to stop in process (the process client's counterpart ends its process)."""

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """One step. A failure in the executor ends only the requests it can be pinned on (their
        outputs carry the error); any other exception means the core's state is in doubt: the
        caller's engine cannot go on."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if self.scheduler.has_unfinished_requests():  # held blocks give way: this is a bug
                raise RuntimeError("no request can be scheduled though some are waiting")
            return []
        result, failures = self._execute(scheduler_output)
        failed = [self._fail(request_id, error) for request_id, error in failures.items()]
        self.faults.after_execute()
        updated = self.scheduler.update(scheduler_output, result)
        return [_output(request, result) for request in updated] + failed

    def _execute(self, scheduler_output: SchedulerOutput) -> tuple[ModelRunnerOutput, dict[str, Exception]]:
        """The step's forward pass and sampling; if it raises, each request again on its own, so that
        one request's failure (a kernel error on its rows, a bad parameter that got through) ends
        that request and the others go on. Rerunning is safe: a request's K/V slots are written with
        the same values, the worker takes the same message in again to the same effect, and nothing
        is sampled until a run succeeds."""
        try:
            return self._run(scheduler_output), {}
        except Exception as exc:  # noqa: BLE001 - pinned on requests below
            if len(scheduler_output.scheduled) == 1:
                return ModelRunnerOutput(), {scheduler_output.scheduled[0].request_id: exc}
            logger.warning("a step of %d requests failed (%r): running them one at a time",
                           len(scheduler_output.scheduled), exc)
        merged, failures = ModelRunnerOutput(), {}
        # Block copies and finished ids ride with the first run that succeeds (copies are idempotent
        # until a forward pass writes into their targets).
        pending = dataclasses.replace(scheduler_output, scheduled=[])
        for scheduled in scheduler_output.scheduled:
            try:
                part = self._run(dataclasses.replace(pending, scheduled=[scheduled]))
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                failures[scheduled.request_id] = exc
                continue
            merged.merge(part)
            pending = dataclasses.replace(pending, finished_request_ids=set(), blocks_to_copy=[])
        return merged, failures

    def _run(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # Tests' injected faults, as if the executor raised.
        self.faults.in_execute(scheduler_output, self.scheduler.requests)
        return self.executor.execute_model(scheduler_output)

    def _fail(self, request_id: str, error: Exception) -> EngineCoreOutput:
        logger.error("request %s failed: %r", request_id, error)
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return EngineCoreOutput(request_id, finish_reason="error", error=f"{type(error).__name__}: {error}")


def _output(request: Request, result: ModelRunnerOutput) -> EngineCoreOutput:
    """What the step brought a request: the output tokens not reported yet, their logprobs, and its
    finish reason if it has one."""
    new = request.output_token_ids[request.num_reported_tokens:]
    request.num_reported_tokens = request.num_output_tokens
    queue_time = None
    if request.first_scheduled_time is not None:
        queue_time = request.first_scheduled_time - request.arrival_time
    return EngineCoreOutput(request.request_id, new, result.logprobs.get(request.request_id) if new else None,
                            result.prompt_logprobs.get(request.request_id), request.status.finish_reason,
                            request.stop_reason, queue_time)
