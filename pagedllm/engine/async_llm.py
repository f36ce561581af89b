"""AsyncLLM: an asyncio front over the engine, whose loop runs in a thread of its own.

The event loop only validates inputs, queues commands and hands outputs to per-request queues;
the engine thread takes commands between steps and posts each step's outputs back in one call.
Torch releases the GIL while it computes, so the HTTP side stays responsive during steps.

All torch work, loading included, happens in the engine thread. OpenMP (libgomp) keeps a team of
worker threads for each thread that starts parallel work, and once its threads outnumber the
CPUs it lets workers spin only briefly before sleeping: had the model loaded in the main thread,
that idle team would have sent the engine's workers to sleep between kernels (46k context
switches in a 10 s run, a quarter of the throughput lost).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.config import EngineArgs
from pagedllm.core.messages import SchedulerStats
from pagedllm.core.snapshot import EngineSnapshot
from pagedllm.engine.llm_engine import LLMEngine, ProcessedRequest
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics import EngineMetrics
from pagedllm.multimodal.processing import ImagePrompt
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedllm.structured_output.backend import InvalidConstraintError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("pagedllm")
_IDLE_POLL_S = 0.1


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served any more."""


class EngineUnavailableError(RuntimeError):
    """The engine takes no new request now (shutting down, or too many waiting): try again later."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (the others go on)."""


class RequestRefusedError(RequestFailedError):
    """This request's own parameters made it fail inside the engine (a structured output
    constraint the model's vocabulary cannot satisfy): the client's error."""


def request_error(error: str) -> RequestFailedError:
    """The exception a failed request's stream raises, from the engine core's report."""
    refused = error.startswith(f"{InvalidConstraintError.__name__}:")
    return RequestRefusedError(error) if refused else RequestFailedError(error)


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    num_prompt_tokens: int = 0
    num_generated: int = 0
    num_samples: int = 1  # n
    finished: bool = False
    lora_name: str | None = None  # the LoRA adapter it runs under


class RequestStream:
    """The outputs of one request, as deltas; leaving the iteration early aborts the request."""

    def __init__(self, engine: AsyncLLM, request_id: str, stream: _Stream) -> None:
        self.engine, self.request_id, self._stream = engine, request_id, stream

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self._stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it has finished (idempotent)."""
        self.engine.abort(self.request_id)


class AsyncLLM:
    engine: LLMEngine  # set by the engine thread, which loads it

    def __init__(self, args: EngineArgs, max_waiting_requests: int | None = None) -> None:
        self.args = args
        self.error: BaseException | None = None
        self.max_waiting_requests = max_waiting_requests
        self.draining = False  # shutting down: no new requests
        self.on_dead: Callable[[], None] | None = None  # called on the event loop once the engine has died
        # Requests queued for the engine thread and not yet in its scheduler (counted as waiting).
        self._unapplied_adds = 0
        self._adds_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._snapshot_waiters: list[asyncio.Future] = []  # the engine thread's: snapshots asked for
        loaded: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(args, loaded), name="pagedllm-engine", daemon=True)
        self._thread.start()
        engine = loaded.get()
        if isinstance(engine, BaseException):
            raise engine
        self.model_config = engine.model_config
        self.max_model_len = engine.max_model_len
        self.takes_images = engine.images is not None
        self.metrics = EngineMetrics(args.served_name())
        # Each engine replica's, as of its last step (one replica without data parallelism).
        self.replica_stats: list[SchedulerStats] = engine.replica_stats()

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The calling thread's own copy of the tokenizer."""
        return self.engine.tokenizer

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats.merge(self.replica_stats)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the engine thread posts outputs (and its death) to."""
        self._loop = loop

    @property
    def num_streams(self) -> int:
        """Requests whose stream is still open (neither finished nor aborted)."""
        return len(self._streams)

    @property
    def is_dead(self) -> bool:
        return self.error is not None or not self._thread.is_alive()

    # -- the event loop's side ------------------------------------------------------------------
    def process_inputs(
        self,
        prompt: str | list[int] | ImagePrompt,
        params: SamplingParams | PoolingParams | BeamSearchParams,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Tokenize and validate (raises ValueError); any thread may call it."""
        return self.engine.process_inputs(prompt, params, lora_request)

    def process_pair(self, text_1: str, text_2: str, params: PoolingParams) -> ProcessedRequest:
        """A pair of texts for a cross-encoder, tokenized together (LLMEngine.process_pair); any thread."""
        return self.engine.process_pair(text_1, text_2, params)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """That LoRA is enabled and the adapter fits the model (LLMEngine.check_lora; ValueError)."""
        self.engine.check_lora(lora_request)

    def check_task(self, task: str) -> None:
        """Raises ValueError if this engine does not serve `task` ("generate" or "embed")."""
        self.engine.check_task(task)

    def check_params(self, params: SamplingParams | PoolingParams | BeamSearchParams) -> None:
        """What the parameters cannot check alone (LLMEngine.check_params)."""
        self.engine.check_params(params)

    def check_priority(self, priority: int) -> None:
        """That the scheduling policy takes this priority (LLMEngine.check_priority; ValueError)."""
        self.engine.check_priority(priority)

    def default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json defaults, as vLLM applies them."""
        return self.engine.default_sampling_params()

    def add_request(self, request_id: str, processed: ProcessedRequest) -> RequestStream:
        return self.add_requests([(request_id, processed)])[0]

    def add_requests(self, requests: list[tuple[str, ProcessedRequest]]) -> list[RequestStream]:
        """Queue validated requests, all or none. Raises EngineDeadError if the engine has stopped;
        EngineUnavailableError while it drains for shutdown or when they would take the waiting
        queue past its limit; ValueError for more requests than that limit admits at once (no
        retry could ever succeed) and for an id in use."""
        if self.is_dead:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        if self.draining:
            raise EngineUnavailableError("the server is shutting down")
        limit = self.max_waiting_requests
        if limit is not None and len(requests) > limit:
            raise ValueError(
                f"{len(requests)} prompts in one request, more than the {limit} this server queues "
                f"at once (--max-waiting-requests): send them in smaller requests"
            )
        with self._adds_lock:
            waiting = self.stats.num_waiting + self._unapplied_adds
        if limit is not None and waiting + len(requests) > limit:
            raise EngineUnavailableError(f"too many requests waiting ({waiting}): try again shortly", retry_after=1)
        ids = [request_id for request_id, _ in requests]
        in_use = [request_id for request_id in ids if request_id in self._streams]
        if in_use or len(set(ids)) < len(ids):
            raise ValueError(f"request id {(in_use or ids)[0]!r} is already in use")
        self._loop = asyncio.get_running_loop()
        return [self._queue_add(request_id, processed) for request_id, processed in requests]

    def _queue_add(self, request_id: str, processed: ProcessedRequest) -> RequestStream:
        params = processed.params
        samples = 1
        if isinstance(params, SamplingParams):
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
            samples = params.n
        elif isinstance(params, BeamSearchParams):  # (its beams come in one output, at its end)
            samples = params.beam_width
        lora = processed.lora_request
        stream = _Stream(
            num_prompt_tokens=len(processed.prompt_token_ids),
            num_samples=samples,
            lora_name=lora.lora_name if lora is not None else None,
        )
        self._streams[request_id] = stream
        with self._adds_lock:
            self._unapplied_adds += 1
        self._commands.put(("add", request_id, dataclasses.replace(processed, params=params)))
        return RequestStream(self, request_id, stream)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        async for output in self.add_request(request_id, self.process_inputs(prompt, params)):
            yield output

    async def encode(self, prompt: str | list[int], params: PoolingParams, request_id: str) -> EmbeddingRequestOutput:
        """An embedding request's result (raises RequestFailedError if the engine failed it)."""
        async for output in self.add_request(request_id, self.process_inputs(prompt, params)):
            assert isinstance(output, EmbeddingRequestOutput)
            return output
        raise RuntimeError(f"request {request_id} ended without an output")

    async def snapshots(self, timeout: float = 5.0) -> list[EngineSnapshot]:
        """Each engine replica's block pool, queues and last steps (the dashboard's), taken between steps."""
        if self.is_dead:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        self._loop = asyncio.get_running_loop()
        waiter = self._loop.create_future()
        self._commands.put(("snapshot", waiter))
        return await asyncio.wait_for(waiter, timeout)

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self._commands.put(("abort", request_id))
            self.metrics.observe_aborted(stream)

    def _dispatch(self, outputs: list[RequestOutput | EmbeddingRequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while the step ran
            new_tokens = sum(len(o.token_ids) for o in output.outputs) if isinstance(output, RequestOutput) else 0
            if new_tokens:
                self.metrics.observe_tokens(stream, new_tokens, now)
            if output.finished:
                stream.finished = True
                self.metrics.observe_finished(stream, output, now)
                # The consumer keeps its own handle; forgetting it here means a stream nobody
                # ever read (its client left before the first byte) leaves nothing behind.
                del self._streams[output.request_id]
            stream.queue.put_nowait(output if output.error is None else request_error(output.error))

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(f"the engine has stopped: {error!r}"))
        if self.on_dead is not None:
            self.on_dead()

    async def drain(self, grace_s: float) -> None:
        """For shutdown: take no new request, give those in flight up to `grace_s` seconds to
        finish, then end the rest (each stream gets an error as its last event)."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        if self._streams:
            logger.info("Shutting down: waiting up to %.0f s for %d requests", grace_s, len(self._streams))
        while self._streams and time.monotonic() < deadline and not self.is_dead:
            await asyncio.sleep(0.05)
        if self._streams:
            logger.warning("Shutting down: ending %d requests still running", len(self._streams))
        for request_id, stream in list(self._streams.items()):
            stream.queue.put_nowait(EngineUnavailableError("the server is shutting down"))
            self.abort(request_id)

    def _fail_one(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.queue.put_nowait(error)

    def shutdown(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self, args: EngineArgs, loaded: queue.SimpleQueue) -> None:
        try:
            self.engine = LLMEngine(args)
        except BaseException as exc:  # the constructor raises it in the caller's thread
            loaded.put(exc)
            return
        loaded.put(self.engine)
        try:
            self.engine.run(self._on_outputs, self._between_steps)
        except BaseException as exc:  # the loop is gone: say so to every waiting request
            logger.exception("engine loop failed")
            self.error = exc
            self._post(self._fail_all, exc)
        finally:
            for waiter in self._snapshot_waiters:
                self._post(_resolve, waiter, EngineDeadError("the engine has stopped"))
            self.engine.shutdown()

    def _on_outputs(self, outputs: list[RequestOutput | EmbeddingRequestOutput]) -> None:
        if outputs:
            self._post(self._dispatch, outputs)

    def _between_steps(self, idle: bool) -> bool:
        """The engine loop's (LLMEngine.run): the stats of the step just run (or of an idle
        core's refresh), snapshots that have come, then the commands queued (waiting for them
        where idle); False once shutting down."""
        self.replica_stats = self.engine.replica_stats()
        if self._snapshot_waiters:
            self._deliver_snapshots()
        if self._stopping.is_set():
            return False
        self._take_commands(wait=idle)
        return True

    def _take_commands(self, wait: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        applied_adds = 0
        while True:
            self._apply(command)
            applied_adds += command[0] == "add"
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        stats = self.engine.replica_stats()
        with self._adds_lock:  # the scheduler's count and the queue's change together
            self.replica_stats = stats
            self._unapplied_adds -= applied_adds

    def _apply(self, command: tuple) -> None:
        kind, request_id = command[0], command[1]
        if kind == "snapshot":  # one snapshot asked for at a time, for every waiter (pages polling together)
            if not self._snapshot_waiters:
                self.engine.request_snapshot()
            self._snapshot_waiters.append(command[1])
            return
        if kind == "abort":
            self.engine.abort_request(request_id)
            return
        try:
            self.engine.add_processed(request_id, command[2])
        except Exception as exc:  # this request fails; the engine goes on
            self._post(self._fail_one, request_id, exc)

    def _deliver_snapshots(self) -> None:
        snapshots = self.engine.take_snapshots()
        if snapshots is not None:
            for waiter in self._snapshot_waiters:
                self._post(_resolve, waiter, snapshots)
            self._snapshot_waiters = []

    def _post(self, fn, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)


def _resolve(waiter: asyncio.Future, result) -> None:
    if waiter.done():  # (its caller may have timed out)
        return
    if isinstance(result, BaseException):
        waiter.set_exception(result)
    else:
        waiter.set_result(result)
