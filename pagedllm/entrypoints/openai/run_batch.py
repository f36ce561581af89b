"""`pagedllm run-batch`: an OpenAI batch file (one request a line) through the server's own app, in
this process, its answers written in the input's order.

Each line is `{"custom_id", "method": "POST", "url", "body"}`; its answer is `{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error": null}`, the body exactly what the
server answers (its errors in their shape). A line that is not a request (not JSON, no unique
custom_id, a route batches do not take) is answered with `"response": null` and `"error":
{"code", "message", "line"}`; the other lines run all the same."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm.auto import tqdm

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.protocol import APIError
from pagedllm.entrypoints.openai.serving_chat import ChatOptions
from pagedllm.entrypoints.openai.serving_models import LoRAModulePath

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/score", "/v1/rerank")


class BatchInputError(ValueError):
    """The input file cannot be read at all (exit 2)."""


@dataclass
class Line:
    """One input line: the request to send, or why it is none."""

    index: int  # among the answered lines, in input order
    number: int  # the line's number in the file (1-based)
    custom_id: str | None = None
    url: str = ""
    body: dict | None = None
    error: tuple[str, str] | None = None  # (code, message)


def read_lines(path: str) -> list[Line]:
    """Every non-blank line of the file, checked as a batch request."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchInputError(f"cannot read the batch file {path}: {exc}") from exc
    lines: list[Line] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            lines.append(_parse(raw, Line(len(lines), number), seen))
    return lines


def _parse(raw: str, line: Line, seen: set[str]) -> Line:
    try:
        item = json.loads(raw)
    except ValueError as exc:
        line.error = ("invalid_json", f"line {line.number} is not JSON: {exc}")
        return line
    if not isinstance(item, dict):
        line.error = ("invalid_request", f"line {line.number} is not a JSON object")
        return line
    custom_id = item.get("custom_id")
    if isinstance(custom_id, str):
        line.custom_id = custom_id
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    problem = (
        ("invalid_request", "custom_id must be a string") if not isinstance(custom_id, str) else
        ("duplicate_custom_id", f"custom_id {custom_id!r} is used by an earlier line") if custom_id in seen else
        ("invalid_request", f"unknown fields: {unknown}") if unknown else
        ("invalid_request", f"method must be POST, got {item.get('method')!r}") if item.get("method") != "POST" else
        ("unsupported_url", f"url {item.get('url')!r} is not one batches take ({', '.join(URLS)})")
        if item.get("url") not in URLS else
        ("invalid_request", "body must be a JSON object") if not isinstance(item.get("body"), dict) else
        None
    )  # fmt: skip
    if isinstance(custom_id, str):
        seen.add(custom_id)
    if problem is not None:
        line.error = (problem[0], f"line {line.number}: {problem[1]}")
        return line
    line.url, line.body = item["url"], item["body"]
    return line


def _refused_stream(line: Line) -> dict | None:
    if line.body is not None and line.body.get("stream") is True:
        return APIError("stream is not supported in a batch file", param="stream").body()
    return None


def answer(line: Line, status: int | None = None, body: Any = None) -> dict:
    """The output line for `line`: the server's answer, or the line's own error."""
    if line.error is not None:
        code, message = line.error
        return {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": line.custom_id,
            "response": None,
            "error": {"code": code, "message": message, "line": line.number},
        }
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id or f"batch-{uuid.uuid4().hex}", "body": body},
        "error": None,
    }


class OrderedWriter:
    """Writes answers in input order as they come (any order), each as soon as those before it are out."""

    def __init__(self, f) -> None:
        self.f, self.next, self.pending = f, 0, {}

    def put(self, index: int, result: dict) -> None:
        self.pending[index] = result
        while self.next in self.pending:
            self.f.write(json.dumps(self.pending.pop(self.next), ensure_ascii=False) + "\n")
            self.next += 1


async def _run_lines(engine: AsyncLLM, app, lines: list[Line], writer: OrderedWriter, concurrency: int, bar) -> bool:
    """POST each line to the app, at most `concurrency` at once, within the app's lifespan (which
    binds the engine to this loop and shuts it down after). Whether the engine died meanwhile."""
    gate = asyncio.Semaphore(concurrency)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client,
    ):

        async def one(line: Line) -> None:
            async with gate:
                writer.put(line.index, await _answer(engine, client, line))
                bar.update(1)

        await asyncio.gather(*(one(line) for line in lines))
        return engine.is_dead


async def _answer(engine: AsyncLLM, client: httpx.AsyncClient, line: Line) -> dict:
    if line.error is not None:
        return answer(line)
    refusal = _refused_stream(line)
    if refusal is not None:
        return answer(line, 400, refusal)
    if engine.is_dead:
        return answer(line, 503, APIError("the engine has stopped", 503, "service_unavailable").body())
    response = await client.post(line.url, json=line.body)
    try:
        body = response.json()
    except ValueError:
        body = response.text
    return answer(line, response.status_code, body)


def run_batch(
    args: EngineArgs,
    input_path: str,
    output_path: str,
    chat_options: ChatOptions | None = None,
    lora_modules: list[LoRAModulePath] | None = None,
    max_concurrency: int | None = None,
    progress: bool = True,
) -> int:
    """Answer every line of `input_path` into `output_path` (written whole at the end, through a
    temporary file beside it). 0: every line answered (errors included); 1: the engine died."""
    if os.path.abspath(input_path) == os.path.abspath(output_path):
        raise BatchInputError("the output file must not be the input file")
    lines = read_lines(input_path)
    if chat_options is not None:
        chat_options.check()
    engine = AsyncLLM(args, max_waiting_requests=None)
    try:
        app = build_app(engine, args.served_name(), None, chat_options, None, lora_modules)
    except BaseException:
        engine.shutdown()
        raise
    concurrency = max_concurrency or 2 * args.max_num_seqs
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per request otherwise)
    temporary = f"{output_path}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        writer = OrderedWriter(f)
        with tqdm(total=len(lines), desc="Running batch", unit="req", disable=not progress, file=sys.stderr) as bar:
            died = asyncio.run(_run_lines(engine, app, lines, writer, concurrency, bar))
    os.replace(temporary, output_path)
    return 1 if died else 0
