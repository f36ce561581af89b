"""Several models behind one server (`--models-dir`, several `--model`): each request goes to the
app of the model its body names (the default model's where it names none), the model loaded on
demand, at most `max_loaded` at once; the least recently used idle one is unloaded to make room,
and any idle past `idle_ttl`. A request for a model still loading waits up to `load_timeout`,
then gets 503. The default model is loaded at start and stays. /v1/models lists every model
(loaded or not, with the adapters of those loaded); /metrics holds every loaded model's series."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.protocol import APIError
from pagedllm.entrypoints.openai.protocol_anthropic import shaped_error
from pagedllm.metrics import render_merged

logger = logging.getLogger("pagedllm")


@dataclass
class ModelEntry:
    name: str
    args: EngineArgs
    pinned: bool = False  # the default model: loaded at start, never unloaded
    engine: AsyncLLM | None = None
    app: FastAPI | None = None
    stack: AsyncExitStack | None = None  # the app's lifespan, exited to unload it
    loading: asyncio.Task | None = None
    active: int = 0  # requests the router is passing to its app now
    last_used: float = field(default_factory=time.monotonic)

    @property
    def loaded(self) -> bool:
        return self.app is not None

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "pagedllm", "root": self.args.model,
                "parent": None, "loaded": self.loaded}  # fmt: skip


def models_in(directory: str) -> dict[str, str]:
    """The models of a folder by name: each subfolder with a config.json (its name), each GGUF file
    but vision projectors (its name without .gguf)."""
    if not os.path.isdir(directory):
        raise ValueError(f"--models-dir {directory!r} is not a folder")
    found = {}
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
            found[entry] = path
        elif entry.endswith(".gguf") and os.path.isfile(path) and not entry.startswith("mmproj"):
            found[entry.removesuffix(".gguf")] = path
    if not found:
        raise ValueError(f"--models-dir {directory!r} holds no model (folders with a config.json, or .gguf files)")
    return found


def model_entries(default: EngineArgs, others: dict[str, str]) -> list[ModelEntry]:
    """The default model's entry first, then one per other model (its own name as served; one rank
    each; the default's engine flags otherwise)."""
    name = default.served_name()
    entries = [ModelEntry(name, default, pinned=True)]
    for other, path in others.items():
        if other == name or os.path.abspath(path) == os.path.abspath(default.model or ""):
            continue  # (the default model found again in the folder)
        args = dataclasses.replace(default, model=path, served_model_name=other, tensor_parallel_size=1,
                                   data_parallel_size=1)  # fmt: skip
        entries.append(ModelEntry(other, args))
    return entries


class ModelRouter:
    """The ASGI app in front of the models' apps (each built by `make_app` over its engine)."""

    def __init__(
        self,
        entries: list[ModelEntry],
        make_app: Callable[[ModelEntry, AsyncLLM], FastAPI],
        max_loaded: int,
        idle_ttl: float | None,
        load_timeout: float,
        max_waiting_requests: int | None = None,
    ) -> None:
        if max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be >= 1, got {max_loaded}")
        self.entries = {e.name: e for e in entries}
        self.default = entries[0]
        self.make_app, self.max_loaded = make_app, max_loaded
        self.idle_ttl, self.load_timeout = idle_ttl, load_timeout
        self.max_waiting_requests = max_waiting_requests
        self._reaper: asyncio.Task | None = None

    def attach_default(self, engine: AsyncLLM) -> None:
        """The default model's engine, loaded before the server starts (its errors stop the start)."""
        self.default.engine = engine
        self.default.app = self.make_app(self.default, engine)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            await self.default.app(scope, receive, send)  # type: ignore[misc]
            return
        path, method = scope["path"], scope["method"]
        if path == "/v1/models" and method == "GET":
            await JSONResponse({"object": "list", "data": self.cards()})(scope, receive, send)
            return
        if path == "/metrics":
            await self._metrics()(scope, receive, send)
            return
        messages, body = await _read(receive)
        try:
            entry = self._entry_for(body)
            await self._ensure_loaded(entry)
        except APIError as error:
            await shaped_error(path, error)(scope, replay(messages, receive), send)
            return
        entry.active += 1
        entry.last_used = time.monotonic()
        try:
            await entry.app(scope, replay(messages, receive), send)  # type: ignore[misc]
        finally:
            entry.active -= 1
            entry.last_used = time.monotonic()

    def cards(self) -> list[dict]:
        cards = []
        for entry in self.entries.values():
            if entry.app is not None:
                cards += [c | {"loaded": True} for c in entry.app.state.models.cards()]
            else:
                cards.append(entry.card())
        return cards

    def _entry_for(self, body: bytes) -> ModelEntry:
        """The model a body names: by its name, or by one of a loaded model's adapters; none: the default."""
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None  # (the app answers a body that is not JSON)
        name = parsed.get("model") if isinstance(parsed, dict) else None
        if not isinstance(name, str):
            return self.default
        if name in self.entries:
            return self.entries[name]
        for entry in self.entries.values():
            if entry.app is not None and name in entry.app.state.models.adapters:
                return entry
        raise APIError(f"The model `{name}` does not exist.", 404, param="model", code="model_not_found")

    async def _ensure_loaded(self, entry: ModelEntry) -> None:
        if entry.engine is not None and entry.engine.is_dead and not entry.pinned:
            logger.warning("model %s: its engine has stopped; loading it again", entry.name)
            await self._unload(entry)
        if entry.loaded:
            return
        if entry.loading is None:
            entry.loading = asyncio.create_task(self._load(entry))
        try:
            await asyncio.wait_for(asyncio.shield(entry.loading), self.load_timeout)
        except asyncio.TimeoutError:
            raise APIError(
                f"model {entry.name} is still loading (past --model-load-timeout {self.load_timeout:g} s): "
                "try again shortly",
                503,
                "service_unavailable",
                headers={"Retry-After": "5"},
            ) from None

    async def _load(self, entry: ModelEntry) -> None:
        try:
            await self._make_room(entry)
            logger.info("Loading model %s (%s)", entry.name, entry.args.model)
            engine = await asyncio.to_thread(AsyncLLM, entry.args, self.max_waiting_requests)
            try:
                app = self.make_app(entry, engine)
                stack = AsyncExitStack()
                await stack.enter_async_context(app.router.lifespan_context(app))
            except BaseException:
                engine.shutdown()
                raise
            entry.engine, entry.app, entry.stack = engine, app, stack
            entry.last_used = time.monotonic()
            logger.info("Model %s loaded", entry.name)
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - a model that cannot load: its requests are told why
            logger.exception("model %s failed to load", entry.name)
            raise APIError(f"model {entry.name} failed to load: {exc}", 500, "internal_server_error") from exc
        finally:
            entry.loading = None

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload the least recently used idle models until one more fits under max_loaded."""
        while True:
            busy = [e for e in self.entries.values() if e is not entry and (e.loaded or e.loading is not None)]
            if len(busy) < self.max_loaded:
                return
            idle = [e for e in busy if e.loaded and not e.pinned and e.active == 0 and not e.engine.num_streams]  # type: ignore[union-attr]
            if not idle:
                raise APIError(
                    f"{len(busy)} models are loaded (--max-loaded-models {self.max_loaded}) and none is idle: "
                    f"model {entry.name} cannot load now; try again shortly",
                    503,
                    "service_unavailable",
                    headers={"Retry-After": "5"},
                )
            await self._unload(min(idle, key=lambda e: e.last_used))

    async def _unload(self, entry: ModelEntry) -> None:
        logger.info("Unloading model %s", entry.name)
        stack, entry.stack, entry.app, entry.engine = entry.stack, None, None, None
        if stack is not None:
            await stack.aclose()  # (the app's lifespan ends: its engine shuts down)
        gc.collect()

    async def _reap(self) -> None:
        """Unload models idle past idle_ttl (the default stays)."""
        assert self.idle_ttl is not None
        while True:
            await asyncio.sleep(min(1.0, self.idle_ttl / 2))
            now = time.monotonic()
            for entry in list(self.entries.values()):
                engine = entry.engine
                idle = entry.active == 0 and engine is not None and not engine.num_streams
                if entry.loaded and not entry.pinned and idle and now - entry.last_used > self.idle_ttl:
                    await self._unload(entry)

    async def _lifespan(self, receive, send) -> None:
        message = await receive()  # lifespan.startup
        async with AsyncExitStack() as stack:
            app = self.default.app
            assert app is not None, "attach_default first"
            await stack.enter_async_context(app.router.lifespan_context(app))
            if self.idle_ttl is not None:
                self._reaper = asyncio.create_task(self._reap())
            await send({"type": "lifespan.startup.complete"})
            message = await receive()  # lifespan.shutdown
            if self._reaper is not None:
                self._reaper.cancel()
            for entry in list(self.entries.values()):
                if not entry.pinned and entry.loaded:
                    await self._unload(entry)
        del message
        await send({"type": "lifespan.shutdown.complete"})

    def _metrics(self) -> Response:
        parts = [(e.engine.metrics, e.engine.replica_stats) for e in self.entries.values() if e.engine is not None]
        return Response(render_merged(parts), media_type="text/plain; version=0.0.4")


async def _read(receive) -> tuple[list[dict], bytes]:
    """The request's body messages (the guard in front has checked its size), and the body."""
    messages = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    return messages, b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")


def replay(messages: list[dict], receive):
    """A receive() that gives the messages already read first, then the connection's own."""
    pending = list(messages)

    async def replay() -> dict:
        return pending.pop(0) if pending else await receive()

    return replay
