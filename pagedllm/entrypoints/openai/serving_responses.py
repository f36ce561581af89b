"""POST /v1/responses (GET and DELETE by id): OpenAI's Responses API over the chat path. The input
items (after the conversation of `previous_response_id`) become chat messages; the output, read by
the chat's parsers, becomes output items (reasoning, message, function_call), in full or as the
Responses stream of events. Responses are kept in memory, the newest MAX_STORED of them (`store`)."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.entrypoints.openai.protocol import APIError
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest, output_messages
from pagedllm.entrypoints.openai.serving import Choice, accumulate, api_error
from pagedllm.entrypoints.openai.serving_chat import (
    BlockStream,
    ChatStart,
    ChoiceStream,
    OpenAIServingChat,
    named_event,
)

MAX_STORED = 1024  # responses kept for GET and previous_response_id, the oldest dropped first


@dataclass
class _Stored:
    response: dict
    conversation: list[dict]  # chat messages through its output, for a response that follows it


class ResponseStore:
    def __init__(self, limit: int = MAX_STORED) -> None:
        self.limit = limit
        self.items: OrderedDict[str, _Stored] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self.items[response["id"]] = _Stored(response, conversation)
        while len(self.items) > self.limit:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> _Stored:
        stored = self.items.get(response_id)
        if stored is None:
            if param is not None:  # a request naming it: its own field is at fault
                raise APIError(f"Previous response with id '{response_id}' not found.", 400, param=param,
                               code="previous_response_not_found")  # fmt: skip
            raise APIError(f"No response with id '{response_id}' found.", 404, "not_found_error")
        return stored

    def delete(self, response_id: str) -> dict:
        self.get(response_id)
        del self.items[response_id]
        return {"id": response_id, "object": "response", "deleted": True}


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    async def create(self, request: ResponsesRequest):
        history = []
        if request.previous_response_id is not None:
            history = self.store.get(request.previous_response_id, "previous_response_id").conversation
        chat_request = request.chat_request(history)
        started = await self.chat.begin(chat_request, "resp")
        build = _Builder(self, request, started, history)
        if request.stream:
            return StreamingResponse(build.events(started.outputs()), media_type="text/event-stream")
        choice = await started.whole_choice()
        return JSONResponse(build.finish(_items(started, choice.text), choice))

    def get(self, response_id: str) -> dict:
        return self.store.get(response_id).response

    def delete(self, response_id: str) -> dict:
        return self.store.delete(response_id)


def _items(started: ChatStart, text: str) -> list[dict]:
    """A whole output's items: reasoning, the message, the function calls."""
    parsed, _ = started.parser.message(text)
    items = []
    if parsed.get("reasoning_content"):
        items.append(_reasoning_item(new_item_id("rs"), parsed["reasoning_content"]))
    if parsed.get("content"):
        items.append(_message_item(new_item_id("msg"), parsed["content"]))
    for call in parsed.get("tool_calls", []):
        function = call["function"]
        items.append(_call_item(new_item_id("fc"), call["id"], function["name"], function["arguments"]))
    return items


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}  # fmt: skip


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


@dataclass
class _Builder:
    """One response's object: its fields echoed from the request, its output and usage; stored at
    the end where the request asks (store)."""

    serving: OpenAIServingResponses
    request: ResponsesRequest
    started: ChatStart
    history: list[dict]
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, items: list[dict], usage: dict | None = None, **extra) -> dict:
        r = self.request
        form = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else None
        tool_choice = r.tool_choice.model_dump() if hasattr(r.tool_choice, "model_dump") else r.tool_choice
        return {
            "id": self.started.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": r.model or self.serving.chat.model_name,
            "output": items,
            "error": None,
            "incomplete_details": None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            "reasoning": r.reasoning.model_dump() if r.reasoning else {"effort": None, "summary": None},
            "store": r.store,
            "temperature": r.temperature,
            "text": {"format": form or {"type": "text"}},
            "tool_choice": tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "top_p": r.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": r.user,
            "metadata": r.metadata or {},
            **extra,
        }

    def finish(self, items: list[dict], choice: Choice) -> dict:
        """The finished response (stored if asked), from its items and its choice's tokens."""
        if self.request.include:  # reasoning.encrypted_content: the text itself, encoded (nothing is secret here)
            for item in items:
                if item["type"] == "reasoning":
                    text = "".join(part["text"] for part in item["content"])
                    item["encrypted_content"] = base64.b64encode(text.encode()).decode()
        incomplete = choice.finish_reason == "length"
        reasoning = "".join(p["text"] for i in items if i["type"] == "reasoning" for p in i["content"])
        output_tokens = len(choice.token_ids)
        usage = {
            "input_tokens": self.started.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            # (the reasoning text retokenized: the output's own split is not kept)
            "output_tokens_details": {"reasoning_tokens": self._count(reasoning)},
            "total_tokens": self.started.num_prompt_tokens + output_tokens,
        }
        response = self.response("incomplete" if incomplete else "completed", items, usage)
        if incomplete:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.request.store:
            conversation = self.history + self.request.input_messages() + output_messages(items)
            self.serving.store.put(response, conversation)
        return response

    def _count(self, text: str) -> int:
        return len(self.serving.chat.engine.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    async def events(self, outputs: AsyncIterator) -> AsyncIterator[str]:
        """response.created, in_progress, each item's events, then response.completed (or
        incomplete; an error event and response.failed if the request fails on the way)."""
        stream = _ItemStream(self.started.parser.stream())
        yield stream.event("response.created", response=self.response("in_progress", []))
        yield stream.event("response.in_progress", response=self.response("in_progress", []))
        choice = Choice()
        try:
            async for _, output in outputs:
                for sample in output.outputs:
                    accumulate({0: choice}, 0, sample)
                    for item in stream.feed(sample.text):
                        yield item
                    if sample.finish_reason is not None:
                        for item in stream.finish():
                            yield item
        except Exception as exc:  # noqa: BLE001 - the engine, the deadline or shutdown ended it: say so last
            error = api_error(exc)
            yield stream.event("error", code=error.code, message=error.message, param=error.param)
            failed = self.response("failed", stream.items)
            failed["error"] = {"code": error.code or "server_error", "message": error.message}
            yield stream.event("response.failed", response=failed)
            return
        finally:
            self.started.close()
        response = self.finish(stream.items, choice)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield stream.event(kind, response=response)


class _ItemStream(BlockStream):
    """The Responses events of a choice's output items: one item at a time, a new one whenever the
    kind changes (reasoning, message) or a call begins."""

    def __init__(self, stream: ChoiceStream) -> None:
        super().__init__(stream)
        self.items: list[dict] = []  # every item so far, the open one last
        self.open: dict | None = None
        self.sequence = 0

    def event(self, kind: str, **payload) -> str:
        self.sequence += 1
        return named_event(kind, {"type": kind, "sequence_number": self.sequence - 1, **payload})

    def _take(self, delta: dict) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            out += self._open("reasoning", None)
            out += self._text_delta("response.reasoning_text.delta", delta["reasoning_content"])
        if delta.get("content"):
            out += self._open("message", None)
            out += self._text_delta("response.output_text.delta", delta["content"])
        for call in delta.get("tool_calls", []):
            if call.get("id") is not None:
                out += self._close()
                out += self._open("function_call", call)
            arguments = call.get("function", {}).get("arguments")
            if arguments and self.open is not None:
                self.open["arguments"] += arguments
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, delta=arguments))  # fmt: skip
        return out

    def _open(self, kind: str, call: dict | None) -> list[str]:
        if self.open is not None and self.open["type"] == kind and kind != "function_call":
            return []
        out = self._close()
        if kind == "reasoning":
            item = _reasoning_item(new_item_id("rs"), "", "in_progress")
        elif kind == "message":
            item = _message_item(new_item_id("msg"), None, "in_progress")
        else:
            assert call is not None
            item = _call_item(new_item_id("fc"), call["id"], call["function"]["name"], "", "in_progress")
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=index, item=_copy(item)))
        if kind == "message":
            item["content"].append(_text_part(""))
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=_text_part("")))  # fmt: skip
        return out

    def _text_delta(self, kind: str, text: str) -> list[str]:
        item = self.open
        assert item is not None
        item["content"][0]["text"] += text
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return [self.event(kind, item_id=item["id"], output_index=len(self.items) - 1, content_index=0, delta=text,
                           **extra)]  # fmt: skip

    def _close(self) -> list[str]:
        item = self.open
        if item is None:
            return []
        self.open = None
        index = len(self.items) - 1
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": index}
        out = []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=item["content"][0]["text"]))  # fmt: skip
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                  logprobs=[]))  # fmt: skip
            out.append(self.event("response.content_part.done", **where, content_index=0, part=_copy(part)))
        else:
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"]))  # fmt: skip
        out.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        return out


def _copy(value: dict) -> dict:
    return json.loads(json.dumps(value))
