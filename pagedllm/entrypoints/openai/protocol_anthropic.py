"""Anthropic's Messages API: request models (pydantic), the conversion to a chat request, and
Anthropic's error shape."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import Field

from pagedllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    Count,
    Int64,
    StructuredOutputsFields,
    _Echoed,
    _Request,
    error_response,
    validated_chat,
)

# Anthropic's error types by HTTP status (docs.anthropic.com, "Errors").
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(error: APIError) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`; the field at fault leads the message
    (Anthropic's shape has no param of its own)."""
    message = error.message
    if error.param and not message.startswith(error.param):
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": message}}


def anthropic_error_response(error: APIError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(error), status_code=error.status, headers=error.headers)


def shaped_error(path: str, error: APIError) -> JSONResponse:
    """The error in the shape of the API the route belongs to: Anthropic's for /v1/messages, else OpenAI's."""
    if path.startswith("/v1/messages"):
        return anthropic_error_response(error)
    return error_response(error)


class CacheControl(_Request):
    type: Literal["ephemeral"]
    ttl: str | None = None  # (a hint: the prefix cache keeps what it keeps)


class TextBlock(_Echoed):
    type: Literal["text"]
    text: str


class ImageSource(_Request):
    type: Literal["base64", "url"]
    media_type: str | None = None  # base64
    data: str | None = None  # base64
    url: str | None = None  # url

    def as_url(self) -> str:
        if self.type == "url":
            if not self.url:
                raise ValueError("an image source of type url needs url")
            return self.url
        if not self.media_type or not self.data:
            raise ValueError("an image source of type base64 needs media_type and data")
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(_Echoed):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Echoed):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Echoed):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(isinstance(part, ImageBlock) for part in self.content):
            raise APIError("images in a tool_result are not supported", param="messages")
        return "".join(part.text for part in self.content if isinstance(part, TextBlock))


class ThinkingBlock(_Echoed):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Echoed):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(_Echoed):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Request):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # (Anthropic's server tools, web search and the rest, are not served)
    cache_control: CacheControl | None = None


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Request):
    """Whether the model thinks first: any type but "disabled" turns a template's thinking switch
    on. The budget is not enforced (max_tokens bounds thinking and answer together)."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks come back empty


class JsonOutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    format: JsonOutputFormat | None = None  # structured output: JSON under the schema
    effort: None = None  # (no effort levels here: only null passes)


class Metadata(_Request):
    user_id: str | None = None


class _Conversation(_Request):
    """What count_tokens and a message request share: the conversation and its tools."""

    model: str
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def chat_fields(self) -> dict:
        """The chat request's fields for the conversation (messages, tools, tool choice, thinking)."""
        fields: dict[str, Any] = {"model": self.model, "messages": self._messages()}
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                if not choice.name:
                    raise APIError('tool_choice of type "tool" needs name', param="tool_choice.name")
                fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        if self.thinking is not None:  # templates with a thinking switch (Qwen3's) read enable_thinking
            fields["chat_template_kwargs"] = {"enable_thinking": self.thinking.type == "enabled"}
        return fields

    def _messages(self) -> list[dict]:
        messages: list[dict] = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            messages.append({"role": "system", "content": text})
        for i, message in enumerate(self.messages):
            try:
                messages += _chat_messages(message)
            except ValueError as exc:
                raise APIError(str(exc), param=f"messages.{i}.content") from exc
        return messages


def _chat_messages(message: AnthropicMessage) -> list[dict]:
    """One Anthropic message as chat messages: a user's tool results become tool messages (before
    the rest of its content); an assistant's tool_use blocks become its tool_calls; thinking
    blocks are the model's own and are not shown to it again."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict] = []
    parts: list[dict] = []
    calls: list[dict] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            if message.role != "user":
                raise ValueError("only user messages carry images")
            parts.append({"type": "image_url", "image_url": {"url": block.source.as_url()}})
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise ValueError("only assistant messages carry tool_use blocks")
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise ValueError("only user messages carry tool_result blocks")
            text = block.text()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
    if message.role == "assistant":
        text = "".join(p["text"] for p in parts)
        if text or calls:
            out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
    elif parts:
        only_text = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "".join(p["text"] for p in parts) if only_text else parts})
    return out


class MessagesRequest(_Conversation):
    """POST /v1/messages."""

    max_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)]
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Count | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # (one tier here)
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # (a hint: every prompt's blocks are cached as they fit)
    speed: Literal["standard"] | None = None
    # Identifiers that change no output, taken as metadata.user_id is.
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Older clients' sampling knobs (and vLLM's extras), as on the chat endpoint.
    structured_outputs: StructuredOutputsFields | None = None
    seed: Int64 | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    priority: Int64 = 0

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion (one choice; Anthropic has no n)."""
        fields = self.chat_fields()
        fields.update(
            max_tokens=self.max_tokens, stream=self.stream, ignore_eos=self.ignore_eos, priority=self.priority
        )
        for name, value in (("stop", self.stop_sequences), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("top_k", self.top_k), ("seed", self.seed),
                            ("cache_salt", self.cache_salt)):  # fmt: skip
            if value is not None:
                fields[name] = value
        if self.structured_outputs is not None:
            fields["structured_outputs"] = self.structured_outputs.model_dump(by_alias=True, exclude_defaults=True)
        if self.output_config is not None and self.output_config.format is not None:
            schema = self.output_config.format.schema_
            fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        return validated_chat(fields)

    @property
    def thinking_omitted(self) -> bool:
        return self.thinking is not None and self.thinking.display == "omitted"


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens."""

    def chat_request(self) -> ChatCompletionRequest:
        return validated_chat(self.chat_fields())
