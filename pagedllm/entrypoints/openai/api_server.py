"""The OpenAI-compatible HTTP server: routes, auth, error shapes, and `pagedllm serve`."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.config import MAX_BODY_BYTES, EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.dashboard import install_dashboard
from pagedllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    error_response,
)
from pagedllm.entrypoints.openai.protocol_anthropic import CountTokensRequest, MessagesRequest, shaped_error
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.router import ModelEntry, ModelRouter, model_entries, replay
from pagedllm.entrypoints.openai.serving import api_error, off_loop
from pagedllm.entrypoints.openai.serving_chat import ChatOptions, OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_messages import AnthropicServingMessages
from pagedllm.entrypoints.openai.serving_models import LoRAModulePath, ServingModels
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses, ResponseStore
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore

logger = logging.getLogger("pagedllm")


@dataclass
class ServerLimits:
    """What one client may ask of the server (flags of `pagedllm serve`)."""

    max_body_bytes: int = MAX_BODY_BYTES
    request_timeout: float | None = None  # seconds from admission to the last token
    allowed_origins: list[str] = field(default_factory=list)  # CORS: none unless asked


def build_app(
    engine: AsyncLLM,
    model_name: str,
    api_key: str | None = None,
    chat_options: ChatOptions | None = None,
    limits: ServerLimits | None = None,
    lora_modules: list[LoRAModulePath] | None = None,
    response_store: ResponseStore | None = None,
) -> FastAPI:
    """The app over `engine`, served as `model_name` with its LoRA adapters (--lora-modules: each
    checked against the model here, a ValueError for one that does not fit). `response_store`:
    the stored Responses, where several models' apps share them."""
    limits = limits or ServerLimits()
    models = ServingModels(engine, model_name)
    models.add_at_start(lora_modules or [])

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.bind_loop(asyncio.get_running_loop())
        sampler = asyncio.create_task(history.run())
        yield
        sampler.cancel()
        engine.shutdown()

    app = FastAPI(title="pagedllm", version=pagedllm.__version__, lifespan=lifespan)
    app.state.models = models  # (the router of several models lists their adapters)
    completions = OpenAIServingCompletion(engine, models, limits.request_timeout)
    chat = OpenAIServingChat(engine, models, chat_options, limits.request_timeout)
    embeddings = OpenAIServingEmbedding(engine, models, limits.request_timeout)
    messages = AnthropicServingMessages(chat)
    responses = OpenAIServingResponses(chat, response_store)
    scores = OpenAIServingScore(engine, models, limits.request_timeout)
    _install_guards(app, api_key, limits)
    history = install_dashboard(app, engine, model_name)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request):
        return await _until_disconnect(raw, completions.create(body))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        return await _until_disconnect(raw, chat.create(body))

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request):
        return await _until_disconnect(raw, responses.create(body))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return responses.delete(response_id)

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, raw: Request):
        return await _until_disconnect(raw, messages.create(body))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest):
        return await messages.count_tokens(body)

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw: Request):
        return await _until_disconnect(raw, embeddings.create(body))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, raw: Request):
        return await _until_disconnect(raw, scores.score(body))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, raw: Request):
        return await _until_disconnect(raw, scores.rerank(body))

    @app.post("/classify")
    async def classify(body: ClassificationRequest, raw: Request):
        return await _until_disconnect(raw, scores.classify(body))

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": models.cards()}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        await models.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        models.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/health")
    async def health():
        if engine.is_dead:
            return error_response(APIError("the engine has stopped", 503, "service_unavailable"))
        if engine.draining:
            return error_response(APIError("the server is shutting down", 503, "service_unavailable"))
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": pagedllm.__version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        completions.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            rendered = await chat.prompt_ids(body)
            tokens = rendered if isinstance(rendered, list) else await chat.image_prompt_ids(rendered)
        else:
            # (engine.tokenizer is the calling thread's own copy: taken in the pool's thread)
            tokens = await off_loop(
                lambda: engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            )
        # Encoded off the loop too: FastAPI's encoder walks a long prompt's ids for a good part of a second.
        body = await off_loop(
            json.dumps, {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}
        )
        return Response(body, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        completions.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < engine.model_config.vocab_size]
        if bad:
            raise APIError(f"token ids out of vocabulary: {bad[:5]}", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(engine.replica_stats), media_type="text/plain; version=0.0.4")

    return app


def _install_guards(app: FastAPI, api_key: str | None, limits: ServerLimits) -> None:
    """Auth, body size, CORS and the error shapes: every failure answers in OpenAI's format."""

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes)
    if limits.allowed_origins:  # added last, so it runs first: preflights need no API key
        app.add_middleware(
            CORSMiddleware, allow_origins=limits.allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )

    @app.exception_handler(APIError)
    async def api_error_(request: Request, exc: APIError):
        return shaped_error(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return shaped_error(request.url.path, _validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return shaped_error(request.url.path, APIError(str(exc.detail), exc.status_code, kind))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):  # a bug: still an answer in the API's shape
        logger.exception("unhandled error in a request")
        return shaped_error(request.url.path, api_error(exc))


def _validation_error(errors: list[dict]) -> APIError:
    """pydantic's errors as one 400: the first field at fault is the param."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # its loc holds a byte offset, not a field
        position = first.get("loc", ("body", "?"))[-1]
        return APIError(
            f"the body is not valid JSON (at byte {position}: {first.get('ctx', {}).get('error')})", code="invalid_json"
        )
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:  # a field this server does not implement, named (see protocol._Request)
        where = ".".join(str(part) for part in unknown[0].get("loc", ())[1:])
        return APIError(f"{where} is not supported by this server", param=where, code="unsupported_parameter")
    where = ".".join(str(part) for part in first.get("loc", ())[1:])
    message = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errors[:3]
    )
    return APIError(message or "invalid request", param=where or None)


# Routes that answer without an API key, as in vLLM: probes and scrapers hold no key. The dashboard's
# page holds no data (its state needs the key, which the page asks for).
_OPEN_PATHS = ("/health", "/metrics", "/version", "/dashboard")


class _Guard:
    """Checks the API key and the body size before a request reaches a route. Plain ASGI, not
    Starlette's BaseHTTPMiddleware, which costs a task and a memory stream per streamed chunk.

    The body is counted as it arrives (a chunked body has no Content-Length to check up front)
    and handed on to the route from memory."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(Request(scope))
            if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
                messages, refusal = await self._read_body(receive)
                receive = replay(messages, receive)
            if refusal is not None:
                await shaped_error(scope["path"], refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, request: Request) -> APIError | None:
        if self.api_key is not None and request.url.path not in _OPEN_PATHS:
            # OpenAI's clients send the key as a bearer token, Anthropic's as x-api-key: either will do.
            bearer = request.headers.get("authorization", "").encode()
            key = request.headers.get("x-api-key", "").encode()
            if not (
                hmac.compare_digest(bearer, f"Bearer {self.api_key}".encode())
                or hmac.compare_digest(key, self.api_key.encode())
            ):
                return APIError("Invalid API key", 401, "authentication_error", code="invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return self._too_large()
        return None

    async def _read_body(self, receive) -> tuple[list[dict], APIError | None]:
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages, None  # the client left: the route sees it go
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return [], self._too_large()
            if not message.get("more_body", False):
                return messages, None

    def _too_large(self) -> APIError:
        return APIError(f"request body larger than {self.max_body_bytes} bytes", 413, code="request_too_large")


async def _until_disconnect(request: Request, handler):
    """Run a handler, cancelling it (and so aborting its requests) if the client goes away."""
    work = asyncio.ensure_future(handler)
    watch = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        watch.cancel()
        return work.result()
    work.cancel()
    return Response(status_code=499)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Server(uvicorn.Server):
    """uvicorn's server, with a drain before its shutdown (SIGTERM: in-flight requests finish within
    `grace_s`, new ones get 503) and a non-zero exit when the engine has died."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, grace_s: float) -> None:
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s
        self.exit_code = 0
        engine.on_dead = self._engine_died

    def _engine_died(self) -> None:
        logger.error("the engine has died: shutting the server down")
        self.exit_code = 1
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        await self.engine.drain(0.0 if self.engine.is_dead else self.grace_s)
        await super().shutdown(sockets)
        # uvicorn re-raises a caught SIGTERM once done, which would end the process by the
        # signal; a drained server has shut down as asked and exits with its own code.
        self._captured_signals.clear()


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a taken port fails in a second, not after it."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port (0-65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@dataclass
class ModelsOptions:
    """Several models on one server (flags of `pagedllm serve`): the others by name -> path."""

    others: dict[str, str] = field(default_factory=dict)
    max_loaded: int = 2
    idle_ttl: float | None = None  # seconds; None: only unloaded to make room
    load_timeout: float = 120.0


def run_server(
    args: EngineArgs,
    host: str,
    port: int,
    api_key: str | None,
    chat_options: ChatOptions,
    limits: ServerLimits | None = None,
    max_waiting_requests: int | None = None,
    shutdown_timeout: float = 10.0,
    lora_modules: list[LoRAModulePath] | None = None,
    models: ModelsOptions | None = None,
) -> int:
    """Serve until stopped; returns the process's exit code (non-zero if the engine died)."""
    chat_options.check()  # before the model loads
    api_key = api_key or os.environ.get("PAGEDLLM_API_KEY") or None
    limits = limits or ServerLimits()
    entries = model_entries(args, models.others) if models is not None and models.others else None
    if entries is not None and (args.tensor_parallel_size > 1 or args.data_parallel_size > 1):
        raise ValueError("several models on one server run one rank each: -tp and -dp take 1 with --models-dir")
    sock = bind_socket(host, port)
    engine = AsyncLLM(args, max_waiting_requests=max_waiting_requests)
    name = args.served_name()
    try:
        if entries is None:
            app = build_app(engine, name, api_key, chat_options, limits, lora_modules)
        else:
            app = _router(entries, engine, api_key, chat_options, limits, lora_modules, models, max_waiting_requests)
    except BaseException:
        engine.shutdown()
        raise
    logger.info("Serving %s (max_model_len %d) at http://%s:%d/v1", name, engine.max_model_len, host, port)
    if entries is not None:
        logger.info("Also serving, loaded on demand: %s", ", ".join(e.name for e in entries[1:]))
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5)
    server = _Server(config, engine, shutdown_timeout)
    server.run(sockets=[sock])
    return server.exit_code


def _router(
    entries: list[ModelEntry],
    engine: AsyncLLM,
    api_key: str | None,
    chat_options: ChatOptions,
    limits: ServerLimits,
    lora_modules: list[LoRAModulePath] | None,
    models: ModelsOptions,
    max_waiting_requests: int | None,
):
    """The router over every model's app, behind one guard (the key is checked before a model loads).
    The default model keeps the chat template and the adapters given; every model takes the parsers."""
    store = ResponseStore()
    others = ChatOptions(None, chat_options.enable_auto_tool_choice, chat_options.tool_call_parser,
                         chat_options.reasoning_parser)  # fmt: skip

    inner = dataclasses.replace(limits, allowed_origins=[])  # (CORS once, in front)

    def make_app(entry: ModelEntry, model_engine: AsyncLLM) -> FastAPI:
        options, adapters = (chat_options, lora_modules) if entry.pinned else (others, None)
        return build_app(model_engine, entry.name, None, options, inner, adapters, store)

    router = ModelRouter(entries, make_app, models.max_loaded, models.idle_ttl, models.load_timeout,
                         max_waiting_requests)  # fmt: skip
    router.attach_default(engine)
    guarded = _Guard(router, api_key, limits.max_body_bytes)
    if not limits.allowed_origins:
        return guarded
    return CORSMiddleware(guarded, allow_origins=limits.allowed_origins, allow_methods=["*"], allow_headers=["*"])
