"""OpenAI's Responses API: request models (pydantic) and the conversion of a request's input items
(with the conversation of its previous response) to chat messages."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from pagedllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    Count,
    Int64,
    StreamOptions,
    StructuredOutputsFields,
    _Echoed,
    _Request,
    validated_chat,
)


class InputText(_Echoed):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None  # (type refusal)


class InputImage(_Echoed):
    type: Literal["input_image"]
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None
    file_id: None = None  # (no files API here)


Part = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(_Echoed):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(_Echoed):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Echoed):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningItem(_Echoed):
    type: Literal["reasoning"]  # the model's own: not shown to it again


def _item_type(value: Any) -> str:
    """An input item's kind: its type, "message" where it has none (`{"role", "content"}`)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: None = None  # (one verbosity here: only null passes)


class ReasoningConfig(_Request):
    """The effort turns a template's thinking switch: "none" off, any other on. Summaries are not
    written (the reasoning text is the item's content): "auto" leaves that to the server."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto"] | None = None
    generate_summary: Literal["auto"] | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # Hints that change no output, taken as chat takes them.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # vLLM's extras, as on the chat endpoint.
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    seed: Int64 | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    structured_outputs: StructuredOutputsFields | None = None
    priority: Int64 = 0
    cache_salt: str | None = None

    def input_messages(self) -> list[dict]:
        """This request's input as chat messages (without the instructions, which are not carried
        to a later response)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict] = []
        for i, item in enumerate(self.input):
            try:
                _append(messages, item)
            except ValueError as exc:
                raise APIError(str(exc), param=f"input.{i}") from exc
        return messages

    def chat_request(self, history: list[dict]) -> ChatCompletionRequest:
        """The request as a chat completion over `history` (the previous response's conversation)
        and this input."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history
        fields: dict[str, Any] = {"messages": messages + self.input_messages(), "stream": self.stream}
        if self.model is not None:
            fields["model"] = self.model
        if self.tools:
            fields["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
        if isinstance(self.tool_choice, FunctionToolChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if not self.parallel_tool_calls:
            fields["parallel_tool_calls"] = False
        form = self.text.format if self.text is not None else None
        if form is not None and form.type != "text":
            if form.type == "json_object":
                fields["response_format"] = {"type": "json_object"}
            elif form.schema_ is None or form.name is None:
                raise APIError("a json_schema format needs name and schema", param="text.format")
            else:
                fields["response_format"] = {"type": "json_schema", "json_schema": {"name": form.name,
                                             "schema": form.schema_}}  # fmt: skip
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["chat_template_kwargs"] = {"enable_thinking": self.reasoning.effort != "none"}
        if self.structured_outputs is not None:
            fields["structured_outputs"] = self.structured_outputs.model_dump(by_alias=True, exclude_defaults=True)
        names = ("max_output_tokens", "temperature", "top_p", "top_k", "seed", "user", "cache_salt")
        for name in names:
            value = getattr(self, name)
            if value is not None:
                fields["max_tokens" if name == "max_output_tokens" else name] = value
        fields.update(ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, priority=self.priority)
        return validated_chat(fields, "input")


def _append(messages: list[dict], item) -> None:
    """One input item as chat messages: consecutive function calls join one assistant message."""
    if isinstance(item, ReasoningItem):
        return
    if isinstance(item, FunctionCallItem):
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and isinstance(last.get("content"), (str, type(None))):
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return
    if isinstance(item, FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else _text(item.output)
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        return
    content: Any = item.content
    if isinstance(content, list):
        if all(isinstance(p, InputText) for p in content):
            content = _text(content)
        else:
            if item.role != "user":
                raise ValueError("only user messages carry images")
            content = [_chat_part(p) for p in content]
    messages.append({"role": item.role, "content": content})


def _text(parts: list) -> str:
    if any(isinstance(p, InputImage) for p in parts):
        raise ValueError("images are taken in user messages only")
    return "".join((p.text if p.text is not None else p.refusal) or "" for p in parts)


def _chat_part(part) -> dict:
    if isinstance(part, InputImage):
        if not part.image_url:
            raise ValueError("an input_image needs image_url (no files API here)")
        return {"type": "image_url", "image_url": {"url": part.image_url}}
    return {"type": "text", "text": part.text or part.refusal or ""}


def output_messages(items: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a later response is given: its text and
    tool calls (its reasoning is its own)."""
    message: dict = {"role": "assistant", "content": None}
    for item in items:
        if item["type"] == "message":
            text = "".join(part.get("text", "") for part in item["content"])
            message["content"] = (message["content"] or "") + text
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            message.setdefault("tool_calls", []).append(call)
    return [message] if message["content"] is not None or message.get("tool_calls") else []
