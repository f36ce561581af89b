"""The OpenAI-compatible HTTP server: routes, auth, error shapes, and `pagedllm serve`."""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, TokenizeRequest, error_response)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

logger = logging.getLogger("pagedllm")
MAX_BODY_BYTES = 8 * 1024 * 1024


def build_app(engine: AsyncLLM, model_name: str, api_key: str | None = None,
              chat_template: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="pagedllm", version=pagedllm.__version__, lifespan=lifespan)
    completions = OpenAIServingCompletion(engine, model_name)
    chat = OpenAIServingChat(engine, model_name, chat_template)
    _install_guards(app, api_key, max_body_bytes)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request):
        return await _until_disconnect(raw, completions.create(body))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        return await _until_disconnect(raw, chat.create(body))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "pagedllm", "root": engine.model_config.path,
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        if engine.is_dead:
            return error_response(APIError("the engine has stopped", 503, "service_unavailable"))
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
            tokens = chat.prompt_ids(body.messages, body.add_generation_prompt)
        else:
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        completions.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < engine.model_config.vocab_size]
        if bad:
            raise APIError(f"token ids out of vocabulary: {bad[:5]}", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(engine.stats), media_type="text/plain; version=0.0.4")

    return app


def _install_guards(app: FastAPI, api_key: str | None, max_body_bytes: int) -> None:
    """Auth, body size and the error shapes: every failure answers in OpenAI's format."""

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:])
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
                            for e in errors[:3])
        return error_response(APIError(message or "invalid request", param=where or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(str(exc.detail), exc.status_code, kind))


class _Guard:
    """Checks the API key and the body size before a request reaches a route. Plain ASGI, not
    Starlette's BaseHTTPMiddleware, which costs a task and a memory stream per streamed chunk."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(Request(scope))
            if refusal is not None:
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, request: Request) -> APIError | None:
        if self.api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return APIError("Invalid API key", 401, "authentication_error", code="invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return APIError(f"request body larger than {self.max_body_bytes} bytes", 413, code="request_too_large")
        return None


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


def run_server(args: EngineArgs, host: str, port: int, api_key: str | None, chat_template_file: str | None) -> None:
    chat_template = None
    if chat_template_file:
        with open(chat_template_file) as f:
            chat_template = f.read()
    api_key = api_key or os.environ.get("PAGEDLLM_API_KEY") or None
    engine = AsyncLLM(args)
    name = args.served_model_name or (args.model or "SmolLM2-135M-Instruct")
    app = build_app(engine, name, api_key, chat_template)
    logger.info("Serving %s (max_model_len %d) at http://%s:%d/v1", name, engine.max_model_len, host, port)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
