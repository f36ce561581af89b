"""OpenAI API request models (pydantic) and the error shape."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedllm.sampling_params import SamplingParams


class APIError(Exception):
    """Raised anywhere in a handler; becomes an OpenAI-shaped error response."""

    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


# Integers as the engine stores them (vLLM bounds seeds the same way): past these a request is
# refused at the edge instead of overflowing inside a step.
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Request(BaseModel):
    # Unknown fields are ignored, as vLLM does, so clients that send more still work; types are
    # strict, so "5" is not taken for 5; NaN and infinities (which Python's JSON reader accepts)
    # are refused.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

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
            raise ValueError(f"{name} holds a lone UTF-16 surrogate ({value[exc.start]!r} at character "
                             f"{exc.start}), which is not valid Unicode") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_unicode(item, name)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, name)
            _check_unicode(item, name)


class StreamOptions(_Request):
    include_usage: bool = False


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
    # Accepted by OpenAI or vLLM but not implemented here yet: refused by name (see `refuse_unsupported`),
    # never silently ignored.
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        """SamplingParams from this request; fields it leaves out take the model's defaults."""
        self.refuse_unsupported()

        def pick(value, default):
            return default if value is None else value

        try:
            bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError as exc:
            raise APIError("logit_bias keys must be token ids", param="logit_bias") from exc
        try:
            return SamplingParams(
                n=self.n, temperature=pick(self.temperature, defaults.temperature),
                top_p=pick(self.top_p, defaults.top_p), top_k=pick(self.top_k, defaults.top_k),
                min_p=pick(self.min_p, defaults.min_p),
                repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty),
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                stop=self.stop, stop_token_ids=self.stop_token_ids, seed=self.seed, max_tokens=max_tokens,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, logit_bias=bias or None,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output)
        except ValueError as exc:
            raise APIError(str(exc)) from exc

    def refuse_unsupported(self) -> None:
        """400 naming the first field that asks for something not implemented (a no-op value passes)."""
        for name in _NOT_IMPLEMENTED:
            value = getattr(self, name, None)
            if value is None or value == [] or value == "none":
                continue
            if name == "response_format" and value.get("type") == "text":
                continue
            raise APIError(f"{name} is not supported by this server yet", param=name, code="unsupported_parameter")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


_NOT_IMPLEMENTED = ("response_format", "tools", "tool_choice", "functions", "function_call", "structured_outputs",
                    "guided_json", "guided_regex", "guided_choice", "guided_grammar")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Count | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int64]
