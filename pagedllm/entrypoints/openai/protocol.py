"""OpenAI API request models (pydantic) and the error shape."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams


class APIError(Exception):
    """Raised anywhere in a handler; becomes an OpenAI-shaped error response."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


# Integers as the engine stores them (vLLM bounds seeds the same way): past these a request is
# refused at the edge instead of overflowing inside a step.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Request(BaseModel):
    # A field this server does not implement is a 400 naming it (vLLM ignores them with a warning:
    # a client would never learn that its setting did nothing); types are strict, so "5" is not
    # taken for 5; NaN and infinities (which Python's JSON reader accepts) are refused.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any, info) -> Any:
        _check_unicode(value, info.field_name)
        return value


def _check_unicode(value: Any, name: str) -> None:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{name} holds a lone UTF-16 surrogate ({value[exc.start]!r} at character "
                f"{exc.start}), which is not valid Unicode"
            ) from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_unicode(item, name)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, name)
            _check_unicode(item, name)


class _Echoed(_Request):
    """A part of a conversation, which clients send back as the server gave it, with fields of
    their own added (OpenAI's client: `refusal`, `annotations`, `parsed`, a streamed call's
    `index`...): what it does not know it ignores."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # (no obfuscation padding is sent either way)


class JsonSchemaFormat(_Request):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise APIError("response_format of type json_schema needs json_schema", param="response_format")
        if self.json_schema.schema_ is None:  # as OpenAI: a json_schema format names its schema
            raise APIError("response_format's json_schema needs a schema", param="response_format.json_schema.schema")
        return StructuredOutputsParams(json=self.json_schema.schema_)


class StructuredOutputsFields(_Request):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=self.json_object,
            disable_any_whitespace=self.disable_any_whitespace,
        )


class SamplingFields(_Request):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None  # prefix-cache hits only among requests with the same salt
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    allowed_token_ids: Annotated[list[Int64], Field(min_length=1)] | None = None
    priority: Int64 = 0  # --scheduling-policy priority: lower first
    use_beam_search: bool = False  # the n best beams (n: the beam width), deterministic
    length_penalty: float = 1.0  # beam search's: a beam scores cum_logprob / length ** length_penalty
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The structured output asked for, and the field that asked (one at most)."""
        given = [name for name in _CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")
        if len(given) > 1:
            raise APIError(
                f"give one structured output constraint, not {len(given)}: {', '.join(given)}", param=given[1]
            )
        if not given:
            return None, None
        name = given[0]
        try:
            if name in ("response_format", "structured_outputs"):
                return getattr(self, name).constraint(), name
            kind = name.removeprefix("guided_")
            return StructuredOutputsParams(**{kind: getattr(self, name)}), name
        except ValueError as exc:
            raise APIError(str(exc), param=name) from exc

    def sampling_params(
        self,
        defaults: SamplingParams,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """SamplingParams from this request; fields it leaves out take the model's defaults."""
        self.refuse_unsupported()
        if self.length_penalty != 1.0:
            raise APIError("length_penalty applies to beam search only (use_beam_search)", param="length_penalty")

        def pick(value, default):
            return default if value is None else value

        try:
            bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError as exc:
            raise APIError("logit_bias keys must be token ids", param="logit_bias") from exc
        try:
            return SamplingParams(
                n=self.n,
                temperature=pick(self.temperature, defaults.temperature),
                top_p=pick(self.top_p, defaults.top_p),
                top_k=pick(self.top_k, defaults.top_k),
                min_p=pick(self.min_p, defaults.min_p),
                repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty),
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=bias or None,
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                structured_outputs=structured_outputs,
            )
        except ValueError as exc:
            raise APIError(str(exc), param=_param_in(str(exc))) from exc

    def beam_search_params(self, max_tokens: int | None, max_model_len: int) -> BeamSearchParams:
        """vLLM's use_beam_search: n beams, temperature 0; a field beam search does not use is
        refused by name."""
        self.refuse_unsupported()
        for name in _NOT_WITH_BEAM_SEARCH:
            if name in type(self).model_fields and getattr(self, name) != type(self).model_fields[name].default:
                raise APIError(f"{name} is not supported with use_beam_search", param=name)
        if self.constraint()[0] is not None:
            raise APIError("structured outputs are not supported with use_beam_search", param=self.constraint()[1])
        try:
            return BeamSearchParams(
                beam_width=self.n,
                max_tokens=max_model_len if max_tokens is None else max_tokens,
                ignore_eos=self.ignore_eos,
                temperature=self.temperature or 0.0,
                length_penalty=self.length_penalty,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ValueError as exc:
            raise APIError(str(exc), param="temperature" if "temperature" in str(exc) else None) from exc

    def refuse_unsupported(self) -> None:
        """400 naming the first OpenAI field that asks for something not implemented; the values
        that ask for nothing (what clients send by default) pass."""
        for name, no_ops in _NO_OP.items():
            if name not in type(self).model_fields:
                continue
            value = getattr(self, name)
            if any(value == v and type(value) is type(v) for v in no_ops):
                continue
            hint = " (use tools and tool_choice)" if name in ("functions", "function_call") else ""
            allowed = ", ".join("null" if v is None else json.dumps(v) for v in no_ops)
            raise APIError(
                f"{name}={json.dumps(value)[:80]} is not supported by this server{hint}; it takes {allowed}",
                param=name,
                code="unsupported_parameter",
            )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


_CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# OpenAI's fields this server does not implement, and the values of each that ask for nothing.
_NO_OP: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),  # OpenAI's deprecated forms of tools
    "function_call": (None, "none"),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
}


def _param_in(message: str) -> str | None:
    """The field a SamplingParams error names first ("bad_words must be ..."), if it is one."""
    name = message.split(" ", 1)[0].rstrip(":")
    return name if name in SamplingFields.model_fields or name == "max_tokens" else None


# What beam search does not use: sampling's knobs, stops the engine finds in text, logprobs, tools.
_NOT_WITH_BEAM_SEARCH = (
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "skip_special_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "best_of",
)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Count | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None


class TextPart(_Echoed):
    type: Literal["text"]
    text: str


class ImageURL(_Echoed):
    url: str  # data:image/...;base64,..., file: (under --allowed-local-media-path) or http(s)
    # Accepted as OpenAI's clients send it; every image is encoded at the model's own resolution.
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(_Echoed):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(_Echoed):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class MessageToolCall(_Echoed):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Echoed):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImageURLPart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs tool_call_id, the id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def as_template_input(self) -> dict:
        content: Any = self.content
        if isinstance(content, list):  # (chat_utils joins text parts alone, loads the images)
            content = [part.model_dump(exclude_none=True) for part in content]
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # Templates write the arguments out themselves (Qwen's with `tojson`): they get the object.
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                }
                for call in self.tool_calls
            ]
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: as the client sent it


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false} for Qwen3
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Hints that change no output, taken as `user` is.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # OpenAI's, refused by refuse_unsupported unless they ask for nothing (_NO_OP).
    functions: Any = None
    function_call: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None


def validated_chat(fields: dict, messages_param: str = "messages") -> ChatCompletionRequest:
    """A chat request built from another API's request (Anthropic's Messages, Responses): its
    errors as a 400 naming the field, the messages by `messages_param` (that API's name for them)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        param = messages_param if where.startswith("messages") else where.split(".")[0] or None
        raise APIError(f"{where}: {first.get('msg')}", param=param) from exc


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request; `truncate_prompt_tokens` and `normalize` are vLLM's extras."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    normalize: bool | None = None
    priority: Int64 = 0


Texts = Annotated[list[str], Field(min_length=1, max_length=2048)]


class ScoreRequest(_Request):
    """vLLM's /score: text_1 against each of text_2 (1:N), or pair by pair (N:N)."""

    model: str | None = None
    text_1: str | Texts
    text_2: str | Texts
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    priority: Int64 = 0
    user: str | None = None


class RerankRequest(_Request):
    """vLLM's /rerank (Jina's and Cohere's shape): the documents by their relevance to the query."""

    model: str | None = None
    query: str
    documents: Texts
    top_n: Annotated[int, Field(ge=0)] | None = None  # (None or 0: all of them)
    return_documents: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    priority: Int64 = 0
    user: str | None = None


class ClassificationRequest(_Request):
    """vLLM's /classify: each input's label probabilities."""

    model: str | None = None
    input: str | Texts
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    priority: Int64 = 0
    user: str | None = None


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or a conversation rendered by the chat template (with its tools)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int64]


# An adapter's name, as a request's `model` names it; a path on the server's disk.
AdapterName = Annotated[str, Field(min_length=1, max_length=256)]


class LoadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: AdapterName
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter."""

    lora_name: AdapterName
    lora_int_id: int | None = None
