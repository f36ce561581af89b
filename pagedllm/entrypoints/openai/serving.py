"""What the completion and chat endpoints share: model check, prompt admission, SSE, logprobs."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineUnavailableError,
    RequestFailedError,
    RequestRefusedError,
    RequestStream,
)
from pagedllm.engine.llm_engine import ProcessedRequest
from pagedllm.entrypoints.openai.protocol import APIError
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import EmbeddingRequestOutput, Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.structured_output.backend import InvalidConstraintError

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.serving_models import ServingModels


def sse(payload: dict | str) -> str:
    """One Server-Sent Event, as OpenAI frames them."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class RequestTimeoutError(TimeoutError):
    pass


def api_error(exc: BaseException) -> APIError:
    """Any exception a request ends with, as the OpenAI-shaped error its client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineUnavailableError):
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        return APIError(str(exc), 503, "service_unavailable", headers=headers)
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), 503, "service_unavailable")
    if isinstance(exc, RequestTimeoutError):
        return APIError(str(exc), 504, "timeout_error", code="request_timeout")
    if isinstance(exc, RequestRefusedError):
        return APIError(str(exc).split(": ", 1)[-1])
    if isinstance(exc, RequestFailedError):
        return APIError(f"the request failed in the engine: {exc}", 500, "internal_server_error")
    if isinstance(exc, ValueError):
        return APIError(str(exc))
    return APIError(f"internal error: {type(exc).__name__}: {exc}", 500, "internal_server_error")


T = TypeVar("T")
# Tokenizing a long prompt or rendering a chat template takes seconds; on the event loop it would
# stall every client (health checks included) for that long.
_TOKENIZE_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagedllm-tokenize")


async def off_loop(fn: Callable[..., T], *args) -> T:
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZE_POOL, fn, *args)


@dataclass
class Choice:
    """One choice's output, accumulated from deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, models: ServingModels, request_timeout: float | None = None) -> None:
        self.engine = engine
        self.models = models
        self.model_name = models.base_name
        self.request_timeout = request_timeout  # seconds from admission to the last token, or None
        self.defaults = engine.default_sampling_params()

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names, None for the served model (an unknown name: 404)."""
        return self.models.lookup(name)

    def check_priority(self, priority: int) -> None:
        """400 naming `priority` where the scheduling policy does not take it."""
        try:
            self.engine.check_priority(priority)
        except ValueError as exc:
            raise APIError(str(exc), param="priority") from exc

    def check_task(self, task: str) -> None:
        """400 if the model does not serve `task` (embeddings from a generation-only engine, or the reverse)."""
        try:
            self.engine.check_task(task)
        except ValueError as exc:
            raise APIError(str(exc), param="model") from exc

    async def admit(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | BeamSearchParams,
        requested_max_tokens: int | None,
        cache_salt: str | None = None,
        constraint_field: str | None = None,
        lora: LoRARequest | None = None,
        priority: int = 0,
    ) -> list[ProcessedRequest]:
        """Tokenize (off the event loop) and validate every prompt before any is queued.
        `constraint_field`: the request field a structured output constraint came from (named by
        the error if it does not compile)."""
        self.check_priority(priority)
        limit = self.engine.max_model_len
        processed = []
        for prompt in prompts:
            try:
                item = await off_loop(self.engine.process_inputs, prompt, params, lora)
                item.cache_salt, item.priority = cache_salt, priority
            except InvalidConstraintError as exc:
                raise APIError(str(exc), param=constraint_field) from exc
            except ValueError as exc:  # the prompt's, unless it names a parameter
                raise APIError(str(exc), param=getattr(exc, "param", "prompt")) from exc
            if requested_max_tokens is not None and len(item.prompt_token_ids) + requested_max_tokens > limit:
                raise APIError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{len(item.prompt_token_ids) + requested_max_tokens} tokens "
                    f"({len(item.prompt_token_ids)} in the prompt, {requested_max_tokens} for the completion).",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            processed.append(item)
        return processed

    def start(self, request_id: str, processed: list[ProcessedRequest]) -> list[RequestStream]:
        try:  # all of a request's prompts, or none
            return self.engine.add_requests([(f"{request_id}-{i}", p) for i, p in enumerate(processed)])
        except ValueError as exc:
            raise APIError(str(exc), param="prompt") from exc
        except (EngineDeadError, EngineUnavailableError) as exc:
            raise api_error(exc) from exc

    async def respond(self, stream: bool, run: Run, streams: list[RequestStream]):
        """SSE as the outputs come, or one JSON body once they are all in."""
        outputs = merge(streams)
        if self.request_timeout is not None:
            outputs = with_deadline(outputs, self.request_timeout)
        if stream:
            return StreamingResponse(run.stream(outputs), media_type="text/event-stream")
        try:
            return JSONResponse(await run.collect(outputs))
        except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
            raise api_error(exc) from exc
        finally:  # cancelled (client gone) before the outputs were read: abort what still runs
            for request_stream in streams:
                request_stream.close()

    async def collect_pooled(self, streams: list[RequestStream]) -> list[EmbeddingRequestOutput]:
        """Every pooling request's one output, in the order of the streams."""
        results: dict[int, EmbeddingRequestOutput] = {}
        outputs = merge(streams)
        if self.request_timeout is not None:
            outputs = with_deadline(outputs, self.request_timeout)
        try:
            async for index, output in outputs:
                results[index] = output
        except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
            raise api_error(exc) from exc
        finally:  # cancelled (client gone): abort what still runs
            for stream in streams:
                stream.close()
        return [results[i] for i in range(len(streams))]

    def logprob_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        return token_bytes(self.engine.tokenizer, token_id)

    @staticmethod
    def created() -> int:
        return int(time.time())


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index.

    A consumer that leaves early (client gone) aborts every request still running."""
    try:
        if len(streams) == 1:
            async for output in streams[0]:
                yield 0, output
        else:
            async for item in _interleave(streams):
                yield item
    finally:
        for stream in streams:
            stream.close()


async def with_deadline(outputs: AsyncIterator[T], seconds: float) -> AsyncIterator[T]:
    """The outputs, until `seconds` have passed; then RequestTimeoutError (which, through `merge`,
    aborts the requests still running)."""
    deadline = time.monotonic() + seconds
    iterator = aiter(outputs)
    try:
        while True:
            try:
                item = await asyncio.wait_for(anext(iterator), deadline - time.monotonic())
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise RequestTimeoutError(f"the request did not finish within {seconds:g} s") from None
            yield item
    finally:
        await iterator.aclose()


async def _interleave(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finished
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


class Run:
    """One request's outputs turned into OpenAI's chunks: the framing both endpoints share."""

    object_name = ""  # of a chunk

    def __init__(self, serving: OpenAIServing, request, request_id: str, num_prompt_tokens: int) -> None:
        self.serving, self.request, self.id = serving, request, request_id
        self.num_prompt_tokens = num_prompt_tokens
        # The name asked for: the model's, or an adapter's (as vLLM answers).
        self.model_name = request.model if request.model in serving.models.adapters else serving.model_name
        self.completion_tokens = 0  # counted by events()
        self.created = serving.created()

    def events(self, outputs: AsyncIterator) -> AsyncIterator[dict]:
        raise NotImplementedError

    async def stream(self, outputs: AsyncIterator) -> AsyncIterator[str]:
        """SSE: the chunks, the usage chunk when asked, an error event if one came, then [DONE]."""
        try:
            async for chunk in self.events(outputs):
                yield sse(chunk)
            if self.request.include_usage:
                yield sse(self.chunk([], usage(self.num_prompt_tokens, self.completion_tokens)))
        except Exception as exc:  # noqa: BLE001 - the engine, the deadline or shutdown ended it: say so last
            yield sse(api_error(exc).body())
        yield sse("[DONE]")

    def chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        chunk = {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }
        if self.request.include_usage:
            chunk["usage"] = usage_
        return chunk


def accumulate(choices: dict[int, Choice], index: int, output) -> Choice:
    choice = choices.setdefault(index, Choice())
    choice.text += output.text
    choice.token_ids += output.token_ids
    choice.logprobs += output.logprobs or []
    choice.finish_reason, choice.stop_reason = output.finish_reason, output.stop_reason
    return choice


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_bytes(tokenizer, token_id: int) -> bytes:
    """A token's own bytes. Decoded alone, a token holding part of a UTF-8 character reads as
    U+FFFD; OpenAI's `bytes` field exists so that clients can join such pieces back together."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # SentencePiece's byte fallback
        return bytes([int(piece[3:5], 16)])
    table = _byte_level_table()
    if all(char in table for char in piece):  # byte-level BPE: one character per byte
        return bytes(table[char] for char in piece)
    return text.encode("utf-8")


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's alphabet, character -> byte: bytes that print stand for themselves, the others
    (controls, space, a few Latin-1 ones) take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens at a position, best first."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)
    return [(token, lp) for token, lp in ranked if lp.rank is not None and lp.rank <= k][:k]
