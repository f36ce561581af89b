"""POST /v1/chat/completions: the conversation (and tools) through the chat template, structured
output and tool_choice as constraints, and the output parsed into reasoning, content and tool
calls, in full or as streaming deltas."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedllm.engine.async_llm import AsyncLLM, RequestStream
from pagedllm.entrypoints.chat_utils import apply_chat_template
from pagedllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    NamedToolChoice,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.serving import (
    Choice,
    OpenAIServing,
    Run,
    accumulate,
    api_error,
    merge,
    new_id,
    off_loop,
    top_entries,
    usage,
    with_deadline,
)
from pagedllm.entrypoints.openai.serving_models import ServingModels
from pagedllm.entrypoints.openai.tool_parsers import ToolCallDelta, ToolCallStream, ToolParser, get_tool_parser
from pagedllm.entrypoints.openai.tool_parsers.constrained import (
    NamedFunctionOutput,
    RequiredFunctionsOutput,
    parameters_schema,
    required_schema,
)
from pagedllm.multimodal.processing import ImagePrompt
from pagedllm.outputs import Logprob
from pagedllm.reasoning import ReasoningParser, ReasoningStream, get_reasoning_parser
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams


@dataclass
class ChatStart:
    """A chat request admitted and started: its id, its streams (one), its prompt's size and the
    parser that reads its output."""

    request_id: str
    streams: list[RequestStream]
    num_prompt_tokens: int
    parser: OutputParser
    request_timeout: float | None = None

    def outputs(self) -> AsyncIterator:
        """Its outputs as they come, until the server's request timeout."""
        outputs = merge(self.streams)
        return outputs if self.request_timeout is None else with_deadline(outputs, self.request_timeout)

    async def whole_choice(self) -> Choice:
        """Its one choice, accumulated to the end (a failure raised as the API error it answers with)."""
        choices: dict[int, Choice] = {}
        try:
            async for _, output in self.outputs():
                for sample in output.outputs:
                    accumulate(choices, 0, sample)
        except Exception as exc:  # noqa: BLE001 - every failure answers in the API's shape (the route's handler)
            raise api_error(exc) from exc
        finally:
            self.close()
        return choices.get(0, Choice())

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


class BlockStream:
    """A choice's streamed deltas (the chat's parser) as another API's events: subclasses turn each
    delta into events (`_take`) and close the open block or item at the end (`_close`)."""

    def __init__(self, stream: ChoiceStream) -> None:
        self.stream = stream

    def feed(self, text: str) -> list[str]:
        return self._take(self.stream.feed(text))

    def finish(self) -> list[str]:
        return self._take(self.stream.finish()) + self._close()

    def _take(self, delta: dict) -> list[str]:
        raise NotImplementedError

    def _close(self) -> list[str]:
        raise NotImplementedError


def named_event(kind: str, payload: dict) -> str:
    """One Server-Sent Event with its event name (Anthropic's and the Responses API's framing)."""
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class ChatOptions:
    """`pagedllm serve`'s chat flags, as vLLM spells them."""

    chat_template: str | None = None  # the template's text
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def check(self) -> None:
        """At start-up: a clear error for flags that do not fit together or name no parser."""
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.tool_call_parser:
            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser:
            get_reasoning_parser(self.reasoning_parser)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLM,
        models: ServingModels,
        options: ChatOptions | None = None,
        request_timeout: float | None = None,
    ) -> None:
        super().__init__(engine, models, request_timeout)
        self.options = options or ChatOptions()
        self.options.check()
        self.tool_parser = get_tool_parser(self.options.tool_call_parser) if self.options.tool_call_parser else None
        self.reasoning_parser = (
            get_reasoning_parser(self.options.reasoning_parser) if self.options.reasoning_parser else None
        )

    async def prompt_ids(self, request: ChatCompletionRequest | TokenizeRequest) -> list[int] | ImagePrompt:
        """The conversation's prompt token ids (or, with images, its rendered text and images,
        which the engine's processor tokenizes), off the event loop."""
        return await off_loop(self._prompt_ids, request)

    async def image_prompt_ids(self, prompt: ImagePrompt) -> list[int]:
        """A conversation with images as the engine tokenizes it (placeholders expanded)."""
        try:
            processed = await off_loop(self.engine.process_inputs, prompt, SamplingParams(max_tokens=1))
        except ValueError as exc:
            raise APIError(str(exc), param="messages") from exc
        return processed.prompt_token_ids

    def _prompt_ids(self, request: ChatCompletionRequest | TokenizeRequest) -> list[int] | ImagePrompt:
        tools = [tool.model_dump(by_alias=True, exclude_none=True) for tool in request.tools or []] or None
        try:
            return apply_chat_template(
                self.engine.tokenizer,
                [m.as_template_input() for m in request.messages],
                self.options.chat_template,
                request.add_generation_prompt,
                tools,
                request.chat_template_kwargs,
                self.engine.args.allowed_local_media_path,
                self.engine.takes_images,
                (self.engine.args.limit_mm_per_prompt or {}).get("image"),
            )
        except ValueError as exc:
            raise APIError(str(exc), param="messages") from exc
        except Exception as exc:  # a template that fails on these messages (jinja raises its own types)
            raise APIError(f"the chat template could not render these messages: {exc}", param="messages") from exc

    async def create(self, request: ChatCompletionRequest):
        started = await self.begin(request, "chatcmpl")
        run = _Run(self, request, started.request_id, started.num_prompt_tokens, started.parser)
        return await self.respond(request.stream, run, started.streams)

    async def begin(self, request: ChatCompletionRequest, id_prefix: str) -> ChatStart:
        """Validate, render, admit and start a chat request: what every API built on chat (this
        one, Anthropic's Messages, OpenAI's Responses) turns into its own answer."""
        lora = self.check_model(request.model)
        self.check_task("generate")
        max_tokens = request.max_completion_tokens or request.max_tokens
        top = request.top_logprobs if request.logprobs else None
        if request.logprobs and top is None:
            top = 0
        if request.use_beam_search:
            params: SamplingParams | BeamSearchParams = request.beam_search_params(
                max_tokens, self.engine.max_model_len
            )
            tools, field = None, None
        else:
            tools, params, field = self._sampling(request, max_tokens, top)
        prompt = await self.prompt_ids(request)
        try:
            processed = await self.admit(
                [prompt], params, max_tokens, request.cache_salt, field, lora, request.priority
            )
        except APIError as exc:
            if isinstance(prompt, ImagePrompt) and exc.param == "prompt":
                exc.param = "messages"  # (the images' processing: a chat request has no prompt field)
            raise
        request_id = new_id(id_prefix)
        streams = self.start(request_id, processed)
        parser = OutputParser(self.reasoning_parser, tools)
        return ChatStart(request_id, streams, len(processed[0].prompt_token_ids), parser, self.request_timeout)

    def _sampling(
        self, request: ChatCompletionRequest, max_tokens: int | None, top: int | None
    ) -> tuple[ToolParser | None, SamplingParams, str | None]:
        """(the parser of the output's tool calls, the sampling parameters, the field a constraint came from)."""
        tools, constraint, field = self._tool_calls(request)
        if constraint is None:
            constraint, field = request.constraint()
        elif request.constraint()[0] is not None:
            raise APIError(
                f"tool_choice {_choice_name(request.tool_choice)!r} constrains the output itself: "
                "it takes no response_format or structured output",
                param=request.constraint()[1],
            )
        return tools, request.sampling_params(self.defaults, max_tokens, top, None, constraint), field

    def _tool_calls(
        self, request: ChatCompletionRequest
    ) -> tuple[ToolParser | None, StructuredOutputsParams | None, str | None]:
        """How this request's tool calls are made and read: (the parser of the output, the constraint
        that guarantees them, the field it comes from). "auto" parses free text with the server's
        tool-call parser; "required" and a named function constrain the output to the tools' schemas."""
        tools = {tool.function.name: tool.function for tool in request.tools or []}
        choice = request.tool_choice if request.tool_choice is not None else ("auto" if tools else "none")
        if isinstance(choice, NamedToolChoice):
            function = tools.get(choice.function.name)
            if function is None:
                raise APIError(
                    f"tool_choice names the function {choice.function.name!r}, which is not among the "
                    f"tools ({', '.join(tools) or 'none given'})",
                    param="tool_choice",
                )
            schema = parameters_schema(function.parameters)
            return (
                NamedFunctionOutput(function.name),
                StructuredOutputsParams(json=schema, disable_any_whitespace=True),
                "tools",
            )
        if choice == "required":
            if not tools:
                raise APIError('tool_choice "required" needs tools', param="tool_choice")
            schema = required_schema(
                [f.model_dump(exclude_none=True) for f in tools.values()], request.parallel_tool_calls
            )
            return RequiredFunctionsOutput(), StructuredOutputsParams(json=schema, disable_any_whitespace=True), "tools"
        if choice == "auto" and tools:
            if self.tool_parser is None or not self.options.enable_auto_tool_choice:
                raise APIError(
                    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                    param="tool_choice",
                )
            return self.tool_parser, None, None
        return None, None, None


def _choice_name(choice) -> str:
    return "named function" if isinstance(choice, NamedToolChoice) else str(choice)


class OutputParser:
    """A choice's text into the assistant message's parts: reasoning split off first (the
    --reasoning-parser), then tool calls read from what is left (the tool parser of the request)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    def message(self, text: str) -> tuple[dict, bool]:
        """The message, and whether it holds tool calls."""
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        calls = []
        if self.tools is not None and content is not None:
            parsed = self.tools.parse(content)
            content, calls = parsed.content, parsed.tool_calls
        message = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        return message, bool(calls)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(
            self.reasoning.stream() if self.reasoning else None, self.tools.stream() if self.tools else None
        )


class ChoiceStream:
    """One choice's streaming parse: text deltas in, OpenAI's delta dicts out."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    def feed(self, text: str) -> dict:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        calls: list[ToolCallDelta] = []
        if self.tools is not None and content:
            content, calls = self.tools.feed(content)
        return _delta(reasoning, content, calls)

    def finish(self) -> dict:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content) if content else ("", [])
            rest, more = self.tools.finish()
            content, calls = content + rest, calls + more
        return _delta(reasoning, content, calls)

    @property
    def called(self) -> bool:
        return self.tools is not None and bool(self.tools.tool_calls)


def _delta(reasoning: str, content: str, calls: list[ToolCallDelta]) -> dict:
    delta: dict = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = [_call_delta(c) for c in calls]
    return delta


def _call_delta(call: ToolCallDelta) -> dict:
    """OpenAI's shape: the first delta of a call has its id, type and name, the others arguments only."""
    if call.id is not None:
        return {
            "index": call.index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
    return {"index": call.index, "function": {"arguments": call.arguments}}


class _Run(Run):
    object_name = "chat.completion.chunk"

    def __init__(
        self,
        serving: OpenAIServingChat,
        request: ChatCompletionRequest,
        request_id: str,
        num_prompt_tokens: int,
        parser: OutputParser,
    ) -> None:
        super().__init__(serving, request, request_id, num_prompt_tokens)
        self.parser = parser

    async def collect(self, outputs: AsyncIterator) -> dict:
        choices: dict[int, Choice] = {}
        async for _, output in outputs:
            for sample in output.outputs:
                accumulate(choices, sample.index, sample)
        body = []
        for i, c in sorted(choices.items()):
            message, called = self.parser.message(c.text)
            body.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": _finish_reason(c.finish_reason, called),
                    "stop_reason": c.stop_reason,
                }
            )
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model_name,
            "choices": body,
            "usage": usage(self.num_prompt_tokens, completion_tokens),
        }

    async def events(self, outputs: AsyncIterator) -> AsyncIterator[dict]:
        parsers: dict[int, ChoiceStream] = {}
        for index in range(self.request.n):  # the role first, for every choice
            parsers[index] = self.parser.stream()
            yield self.chunk(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        async for _, output in outputs:
            for sample in output.outputs:
                self.completion_tokens += len(sample.token_ids)
                parser = parsers[sample.index]
                delta = parser.feed(sample.text)
                logprobs = self._logprobs(sample.token_ids, sample.logprobs or [])
                if delta or (logprobs and sample.token_ids):
                    yield self.chunk(
                        [{"index": sample.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}]
                    )
                if sample.finish_reason is None:
                    continue
                rest = parser.finish()
                if rest:
                    yield self.chunk([{"index": sample.index, "delta": rest, "logprobs": None, "finish_reason": None}])
                yield self.chunk(
                    [
                        {
                            "index": sample.index,
                            "delta": {},
                            "logprobs": None,  # the finish reason last
                            "finish_reason": _finish_reason(sample.finish_reason, parser.called),
                            "stop_reason": sample.stop_reason,
                        }
                    ]
                )

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]]) -> dict | None:
        if not self.request.logprobs:
            return None
        k = self.request.top_logprobs or 0
        decode = self.serving.logprob_token

        def item(token: int, logprob: float) -> dict:
            text = decode(token)
            return {"token": text, "logprob": logprob, "bytes": list(self.serving.token_bytes(token))}

        return {
            "content": [
                {
                    **item(t, entry[t].logprob),
                    "top_logprobs": [item(tok, lp.logprob) for tok, lp in top_entries(entry, k)],
                }
                for t, entry in zip(token_ids, entries)
            ]
        }


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that ended with tool calls says so, as OpenAI's do."""
    return "tool_calls" if called and reason == "stop" else reason
