"""POST /v1/messages (and count_tokens): Anthropic's Messages API over the chat path. The request
becomes a chat request (protocol.py); the output, read by the chat's parsers, becomes Anthropic's
content blocks (thinking, text, tool_use), in full or as Anthropic's stream of events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.entrypoints.openai.protocol_anthropic import CountTokensRequest, MessagesRequest, anthropic_error_body
from pagedllm.entrypoints.openai.serving import Choice, api_error
from pagedllm.entrypoints.openai.serving_chat import (
    BlockStream,
    ChatStart,
    ChoiceStream,
    OpenAIServingChat,
    named_event,
)


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, request: MessagesRequest):
        chat_request = request.chat_request()
        started = await self.chat.begin(chat_request, "msg")
        name, omit = request.model, request.thinking_omitted
        if request.stream:
            events = _events(started.outputs(), started, name, omit)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(_message(started, name, await started.whole_choice(), omit))

    async def count_tokens(self, request: CountTokensRequest) -> dict:
        chat_request = request.chat_request()
        self.chat.check_model(chat_request.model)
        prompt = await self.chat.prompt_ids(chat_request)
        tokens = prompt if isinstance(prompt, list) else await self.chat.image_prompt_ids(prompt)
        return {"input_tokens": len(tokens)}


def _message(started: ChatStart, model: str, choice: Choice, omit_thinking: bool) -> dict:
    parsed, called = started.parser.message(choice.text)
    content: list[dict] = []
    if parsed.get("reasoning_content"):
        thinking = "" if omit_thinking else parsed["reasoning_content"]
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if parsed.get("content"):
        content.append({"type": "text", "text": parsed["content"]})
    for call in parsed.get("tool_calls", []):
        content.append(
            {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
             "input": _arguments(call["function"]["arguments"])}
        )  # fmt: skip
    reason, sequence = _stop_reason(choice.finish_reason, choice.stop_reason, called)
    return {
        "id": started.request_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": started.num_prompt_tokens, "output_tokens": len(choice.token_ids)},
    }


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop_reason(finish: str | None, stop: int | str | None, called: bool) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason (and the stop sequence met) for a choice's finish."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


async def _events(outputs: AsyncIterator, started: ChatStart, model: str, omit_thinking: bool) -> AsyncIterator[str]:
    """message_start, each block's start, deltas and stop, message_delta (stop reason, usage),
    message_stop; an error event if the request fails on the way."""
    head = {
        "id": started.request_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": started.num_prompt_tokens, "output_tokens": 0},
    }  # fmt: skip
    yield named_event("message_start", {"type": "message_start", "message": head})
    blocks = _Blocks(started.parser.stream(), omit_thinking)
    tokens, finish, stop = 0, None, None
    try:
        async for _, output in outputs:
            for sample in output.outputs:
                tokens += len(sample.token_ids)
                for item in blocks.feed(sample.text):
                    yield item
                if sample.finish_reason is not None:
                    finish, stop = sample.finish_reason, sample.stop_reason
                    for item in blocks.finish():
                        yield item
    except Exception as exc:  # noqa: BLE001 - the engine, the deadline or shutdown ended it: say so last
        yield named_event("error", anthropic_error_body(api_error(exc)))
        return
    finally:
        started.close()
    reason, sequence = _stop_reason(finish, stop, blocks.stream.called)
    delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": {"output_tokens": tokens}}  # fmt: skip
    yield named_event("message_delta", delta)
    yield named_event("message_stop", {"type": "message_stop"})


class _Blocks(BlockStream):
    """Anthropic's content blocks: one block at a time, a new one whenever the kind changes
    (thinking, text) or a tool call begins."""

    def __init__(self, stream: ChoiceStream, omit_thinking: bool) -> None:
        super().__init__(stream)
        self.omit_thinking = omit_thinking
        self.index = -1
        self.kind: str | None = None

    def _take(self, delta: dict) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if not self.omit_thinking:
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", []):
            if call.get("id") is not None:  # a new call: a block of its own
                out += self._close()
                block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
                out += self._open("tool_use", block)
            arguments = call.get("function", {}).get("arguments")
            if arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return out

    def _open(self, kind: str, block: dict) -> list[str]:
        if self.kind == kind and kind != "tool_use":
            return []
        out = self._close()
        self.index += 1
        self.kind = kind
        out.append(named_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block}))  # fmt: skip
        return out

    def _delta(self, delta: dict) -> str:
        return named_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [named_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]
