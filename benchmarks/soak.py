"""Soak test of the real server: many mixed requests at once, clients leaving, KV too small.

    .venv/bin/python benchmarks/soak.py                      # 1,000 requests, default model

A quick run (half a minute) on a tiny random model, whose KV is so small that it needs its own
budget to preempt:

    .venv/bin/python benchmarks/make_model.py --out /tmp/tiny --hidden-size 64 --num-layers 2 \
        --num-heads 4 --num-kv-heads 2 --intermediate-size 128 --vocab-size 49152 --dtype float32
    .venv/bin/python benchmarks/soak.py --model /tmp/tiny --requests 100 --kv-cache-memory 256KiB \
        --rss-interval 0.1

It starts `pagedllm serve` (stdout and stderr to --log), sends --requests requests, --concurrency
at a time, and stops the server (SIGTERM, then SIGKILL after --shutdown-wait s). The workload is
drawn from --seed, so a rerun sends the same requests:

- /v1/completions or /v1/chat/completions (half each), streamed or not (half each), n = 1 or 2;
- greedy (temperature 0) or sampled (temperature 0.8, top_p 0.95, a seed half the time);
- short prompts (a few words) or long ones (--long-words words, a shared preamble half the time,
  so that prefix caching shares blocks under preemption), max_tokens in --max-tokens;
- ignore_eos on most, so that every kept request's length is known in advance;
- --drop-fraction of the streams close their connection after a random number of chunks.

--mixed adds every feature a request can reach (the run issue 42 asks for): the generation server
runs two data-parallel replicas (-dp 2) with n-gram speculation and the hermes tool template; of
the requests, --lora-fraction name one of --lora-adapters random PEFT adapters (written for the
model at start; all but one served with --lora-modules, the last loaded at runtime through
/v1/load_lora_adapter; two a step and two in memory, so that the scheduler's limit and the LRU both
work), their greedy ones replayed alone under the same adapter; --json-fraction ask for JSON under
a schema (response_format on chat, vLLM's structured_outputs on completions) and --tools-fraction
are chat requests whose tool_choice is "required" or a named function (streamed or not); and
--embeddings-fraction go to a second server beside it (--embeddings-model, default: the default
model with --runner pooling), as embeddings of one to four texts. --images-fraction (with a
vision-language --model, and a chat template that writes its image placeholder:
benchmarks/data/qwen2_vl_chat_template.jinja for a tiny Qwen2-VL) sends chat requests with an image
part (a base64 PNG, one of four pictures of different sizes, so that the encoder cache and the
prefix cache see repeats) and text, greedy or sampled, streamed or not, n = 1 or 2; the greedy ones
are replayed alone like text requests. Their checks: a JSON answer parses and holds to its schema;
every tool call names a tool and its arguments hold to that tool's parameters (a choice that
max_tokens cut short, its finish reason "length", is not judged: the grammars allow any whitespace,
which a sampled request can draw until it runs out); each embedding has the same dimensions and
unit length; the embeddings server ends idle, exits 0, and logs no error.

The KV budget (--kv-cache-memory) is far below what --concurrency requests hold, so the
scheduler must preempt; the preemption counter has to grow, or the run proves nothing.

Checks (any failing makes the exit status 1):
- no 5xx, no other error status, no transport error, no error event inside a stream;
- no hang: every request answers within --timeout s;
- every kept request (not dropped) complete: [DONE] or a full body, n choices each with a finish
  reason, "length" and n * max_tokens completion tokens where ignore_eos was set;
- afterwards, within --idle-wait s, zero requests running or waiting, and KV usage back at the
  value it had before the soak (0: blocks that only hold cached prefixes count as free);
- greedy output equals the same request sent alone: up to --replay greedy kept requests (spread
  over endpoint, streaming, n and prompt length), and every greedy n = 2 request whose two
  samples differ, are resent one at a time, non-streaming, after the soak, each with a cache salt
  of its own (so that its prompt is computed alone, not read from blocks that the soak's batches
  computed); text per choice, finish reasons and completion tokens must match (streamed text is
  the deltas joined): the engine is batch-invariant in every CPU configuration (issue 44), so any
  difference fails. A differing request is resent once more with top-5 logprobs, and the report
  gives, at its first differing token, how far the soak's pick sits below the alone run's best.
  --allow-rounding-flips passes a difference that starts at a near-tie (within --tie-margin nats,
  0.3, tests/test_bf16_oracle.py's EPS; the same token count where ignore_eos was set), for a
  configuration that is not invariant (-tp in bf16, another engine). The replay covers text
  requests (a constrained one's flip has no text to place it by);
- resident memory flat over the second half: the server's RSS is sampled every --rss-interval s
  (1; at least 10 samples are needed); growth = median of the last 10% of samples / median of
  the 10% around the run's midpoint - 1 < 5%;
- the server exits 0 on SIGTERM, and its log holds no Traceback or ERROR line.

A quick run with images (a minute) on a tiny Qwen2-VL:

    .venv/bin/python -c "import sys; sys.path[:0] = ['tests']; import conftest, vlm_utils; \
        from transformers import AutoTokenizer; \
        AutoTokenizer.from_pretrained(conftest.default_model_dir(), gguf_file=conftest._DEFAULT_GGUF)\
        .save_pretrained('/tmp/tok'); vlm_utils.make_qwen2_vl('/tmp/tiny-vl', '/tmp/tok')"
    .venv/bin/python benchmarks/soak.py --model /tmp/tiny-vl --requests 100 --kv-cache-memory 1MiB \
        --rss-interval 0.1 --images-fraction 0.5 \
        --extra-server-args "--chat-template benchmarks/data/qwen2_vl_chat_template.jinja"

(A GGUF text model with its projector file: --model TEXT.gguf and "--mmproj FILE" among the
--extra-server-args.)

--timeout must suit the machine: with 48 requests in flight, a request's latency is about 48 /
(requests/s). On the project's 2-core machine (shared) the default run took 4-5 minutes in bf16;
with --extra-server-args "--dtype float32" 2.5x longer, and it needs --timeout 300.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import psutil

WORDS = (
    "the of and to in is was for on that with as by at from his her they this which have are not but had "
    "one all were when there been their more time would about out who what into some them other than then "
    "only its over also new after first two most may well such way even many year old work world life day "
    "back long great little house water light river stone city road field garden window morning evening "
    "winter summer music story paper letter market bridge forest mountain island village ship train "
    "people child friend teacher doctor farmer king queen horse bird tree flower apple bread cheese"
).split()
TOPICS = ("rivers", "bridges", "winter", "markets", "trains", "gardens", "music", "islands", "bread", "letters")
PREAMBLE_WORDS = 64  # the shared start of half the long prompts: four 16-token blocks and more
# What the --mixed run's constrained requests ask for: bounded, so that they finish within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 16},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["topic", "rating"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Rome", "Oslo"]},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CONSTRAINED_MAX_TOKENS = 64


def _pictures() -> list[str]:
    """Four random pictures of different sizes, as base64 PNG data URLs."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(46)
    urls = []
    for size in ((40, 33), (90, 64), (20, 100), (64, 64)):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(buffer, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())
    return urls


PICTURES = _pictures()
MIXED_SERVER_ARGS = (
    '-dp 2 --speculative-config \'{"method": "ngram", "num_speculative_tokens": 3}\' '
    "--chat-template "
    + os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "tool_chat_template_hermes.jinja")
)


@dataclass
class Spec:
    """One request of the workload, as drawn from the seed."""

    index: int
    chat: bool
    stream: bool
    n: int
    greedy: bool
    long: bool
    max_tokens: int
    ignore_eos: bool
    seed: int | None
    drop_after: int | None  # streams only: chunks read before the client closes the connection
    prompt: str
    kind: str = "text"  # "text", "json" (a schema), "tools" (tool_choice required or named), "embed", "beams", "image"
    tool_choice: str | dict | None = None
    picture: int = 0  # an "image" request's: which of PICTURES
    adapter: str | None = None  # the LoRA adapter it names as its model (--lora-fraction)
    bad_words: list[str] | None = None  # words it must not generate (--bad-words-fraction)
    priority: int = 0  # under --scheduling-policy priority (--priority-fraction)
    api: str = "openai"  # a chat request's API: "openai", "responses" or "messages" (--api-fraction)
    model: str | None = None  # the served model's name, which the Messages API needs (set before sending)

    @property
    def ends_itself(self) -> bool:
        """A constrained request ends when its grammar completes, whatever ignore_eos says."""
        return self.kind in ("json", "tools")

    def body(self, stream: bool | None = None, cache_salt: str | None = None) -> dict:
        stream = self.stream if stream is None else stream
        body: dict = {
            "max_tokens": self.max_tokens,
            "n": self.n,
            "stream": stream,
            "ignore_eos": self.ignore_eos,
            "temperature": 0.0 if self.greedy else 0.8,
        }
        if not self.greedy:
            body["top_p"] = 0.95
        if self.seed is not None:
            body["seed"] = self.seed
        if stream:
            body["stream_options"] = {"include_usage": True}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if self.adapter is not None:
            body["model"] = self.adapter
        if self.bad_words is not None:
            body["bad_words"] = self.bad_words
        if self.priority:
            body["priority"] = self.priority
        if self.kind == "embed":
            return {"input": self.prompt.split(" | ")}
        if self.kind == "image":
            parts = [{"type": "image_url", "image_url": {"url": PICTURES[self.picture]}}]
            body["messages"] = [{"role": "user", "content": [*parts, {"type": "text", "text": self.prompt}]}]
        elif self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.kind == "json":
            if self.chat:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
            else:
                body["structured_outputs"] = {"json": SCHEMA}
        if self.kind == "tools":
            body.update({"tools": TOOLS, "tool_choice": self.tool_choice, "parallel_tool_calls": False})
        if self.kind == "beams":  # the n best beams (use_beam_search): deterministic, no sampling fields
            body.update(use_beam_search=True, length_penalty=1.0)
        return self._other_api(body)

    def _other_api(self, body: dict) -> dict:
        """The chat body as the Responses or the Messages API takes it."""
        if self.api == "openai":
            return body
        messages, max_tokens = body.pop("messages"), body.pop("max_tokens")
        body.pop("n"), body.pop("stream_options", None)
        if self.api == "responses":
            return {**body, "input": messages, "max_output_tokens": max_tokens}
        return {**body, "model": body.get("model", self.model), "messages": messages, "max_tokens": max_tokens}

    @property
    def path(self) -> str:
        if self.kind == "embed":
            return "/v1/embeddings"
        if self.api != "openai":
            return {"responses": "/v1/responses", "messages": "/v1/messages"}[self.api]
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclass
class Result:
    """What came back for one request."""

    spec: Spec
    status: int | None = None
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    completion_tokens: int | None = None
    done: bool = False  # [DONE] seen, or the whole body read
    dropped: bool = False  # the client left mid-stream, as planned
    hang: bool = False
    error: str | None = None  # error status body, stream error event, or transport failure
    seconds: float = 0.0
    calls: dict[int, dict[int, list[str]]] = field(default_factory=dict)  # choice -> call -> [name, arguments]
    vectors: list[list[float]] | None = None  # an embeddings request's


# -- the workload --------------------------------------------------------------------------------
def make_prompt(rng: random.Random, long: bool, long_words: tuple[int, int], preamble: list[str]) -> str:
    if not long:
        return f"Tell me about {rng.choice(TOPICS)} and {rng.choice(WORDS)}"
    words = [rng.choice(WORDS) for _ in range(rng.randint(*long_words))]
    if rng.random() < 0.5:
        words[:PREAMBLE_WORDS] = preamble
    return " ".join(words).capitalize() + "."


def make_spec(index: int, rng: random.Random, args: argparse.Namespace, preamble: list[str]) -> Spec:
    """A request of the mix; --lora-fraction of the text and constrained ones under an adapter (no
    draw without it, so that a seed's workload stays what it was)."""
    spec = draw_spec(index, rng, args, preamble)
    if args.lora_fraction > 0 and spec.kind in ("text", "json", "tools") and rng.random() < args.lora_fraction:
        spec.adapter = rng.choice(lora_names(args))
    if (
        args.bad_words_fraction > 0
        and spec.kind in ("text", "json", "tools")
        and rng.random() < args.bad_words_fraction
    ):
        spec.bad_words = rng.sample(WORDS, 3)
    if args.priority_fraction > 0 and spec.kind != "embed" and rng.random() < args.priority_fraction:
        spec.priority = rng.randint(-2, 2)
    plain_chat = spec.kind == "text" and spec.chat and spec.n == 1 and spec.bad_words is None
    if args.api_fraction > 0 and plain_chat and rng.random() < args.api_fraction:
        spec.api = rng.choice(["responses", "messages"])
    return spec


def draw_spec(index: int, rng: random.Random, args: argparse.Namespace, preamble: list[str]) -> Spec:
    draw = rng.random()
    if draw < args.images_fraction:
        return image_spec(index, rng, args)
    draw -= args.images_fraction
    if draw < args.embeddings_fraction:
        texts = [
            make_prompt(rng, rng.random() < args.long_fraction, args.long_words, preamble)
            for _ in range(rng.randint(1, 4))
        ]
        return Spec(
            index=index,
            chat=False,
            stream=False,
            n=1,
            greedy=True,
            long=False,
            max_tokens=0,
            ignore_eos=False,
            seed=None,
            drop_after=None,
            prompt=" | ".join(texts),
            kind="embed",
        )
    draw -= args.embeddings_fraction
    if draw < args.json_fraction + args.tools_fraction:
        return constrained_spec(index, rng, args, "json" if draw < args.json_fraction else "tools")
    draw -= args.json_fraction + args.tools_fraction
    if draw < args.beams_fraction:
        return beam_spec(index, rng, args, preamble)
    stream = rng.random() < 0.5
    greedy = rng.random() < 0.5
    long = rng.random() < args.long_fraction
    max_tokens = rng.randint(*args.max_tokens)
    drop = stream and rng.random() < args.drop_fraction
    return Spec(
        index=index,
        chat=rng.random() < 0.5,
        stream=stream,
        n=2 if rng.random() < args.n2_fraction else 1,
        greedy=greedy,
        long=long,
        max_tokens=max_tokens,
        ignore_eos=rng.random() < 0.8,
        seed=rng.randrange(2**31) if not greedy and rng.random() < 0.5 else None,
        # from 2 on, so that a chat stream is past its role chunk, into the tokens
        drop_after=rng.randint(2, max(2, max_tokens // 2)) if drop else None,
        prompt=make_prompt(rng, long, args.long_words, preamble),
    )


def image_spec(index: int, rng: random.Random, args: argparse.Namespace) -> Spec:
    """A chat request with one of PICTURES and a short question: greedy or sampled, streamed or not
    (a quarter of the streams dropped), n = 1 or 2."""
    stream, greedy = rng.random() < 0.5, rng.random() < 0.5
    max_tokens = rng.randint(*args.max_tokens)
    return Spec(
        index=index,
        chat=True,
        stream=stream,
        n=2 if rng.random() < args.n2_fraction else 1,
        greedy=greedy,
        long=False,
        max_tokens=max_tokens,
        ignore_eos=rng.random() < 0.8,
        seed=rng.randrange(2**31) if not greedy and rng.random() < 0.5 else None,
        drop_after=rng.randint(2, max(2, max_tokens // 2)) if stream and rng.random() < args.drop_fraction else None,
        prompt=f"What is in the picture, {rng.choice(TOPICS)} or {rng.choice(WORDS)}?",
        kind="image",
        picture=rng.randrange(len(PICTURES)),
    )


def beam_spec(index: int, rng: random.Random, args: argparse.Namespace, preamble: list[str]) -> Spec:
    """A beam search (use_beam_search) of 2 or 3 beams: streamed or not (its beams come at its end,
    so a stream is never dropped), prompts long or short."""
    long = rng.random() < args.long_fraction
    return Spec(
        index=index,
        chat=rng.random() < 0.5,
        stream=rng.random() < 0.5,
        n=rng.choice((2, 3)),
        greedy=True,
        long=long,
        max_tokens=rng.randint(*args.max_tokens),
        ignore_eos=rng.random() < 0.8,
        seed=None,
        drop_after=None,
        prompt=make_prompt(rng, long, args.long_words, preamble),
        kind="beams",
    )


def constrained_spec(index: int, rng: random.Random, args: argparse.Namespace, kind: str) -> Spec:
    """A request for JSON under SCHEMA, or for a call of one of TOOLS: greedy or sampled, streamed or
    not (a quarter of the streams dropped); it ends when its grammar completes."""
    stream, greedy = rng.random() < 0.5, rng.random() < 0.5
    chat = kind == "tools" or rng.random() < 0.5
    choice = None
    if kind == "tools":
        choice = (
            "required"
            if rng.random() < 0.5
            else {"type": "function", "function": {"name": rng.choice(list(TOOL_SCHEMAS))}}
        )
    topic = rng.choice(TOPICS)
    prompt = (
        f"What is the weather and the time in {rng.choice(['Paris', 'Rome', 'Oslo'])}?"
        if kind == "tools"
        else f"Rate {topic} from 1 to 5, as JSON with a topic and a rating."
    )
    return Spec(
        index=index,
        chat=chat,
        stream=stream,
        n=2 if rng.random() < args.n2_fraction else 1,
        greedy=greedy,
        long=False,
        max_tokens=CONSTRAINED_MAX_TOKENS,
        ignore_eos=False,
        seed=rng.randrange(2**31) if not greedy and rng.random() < 0.5 else None,
        drop_after=rng.randint(2, 6) if stream and rng.random() < args.drop_fraction else None,
        prompt=prompt,
        kind=kind,
        tool_choice=choice,
    )


def make_workload(args: argparse.Namespace) -> list[Spec]:
    rng = random.Random(args.seed)
    preamble = [rng.choice(WORDS) for _ in range(PREAMBLE_WORDS)]
    return [make_spec(i, rng, args, preamble) for i in range(args.requests)]


# -- one request ---------------------------------------------------------------------------------
@dataclass
class Clients:
    """The generation server's client and the embeddings server's (the same one without it)."""

    generate: httpx.AsyncClient
    embed: httpx.AsyncClient


def take_choice(result: Result, choice: dict, chat: bool) -> None:
    """Add one choice (a whole one, or a stream delta) to what the result holds."""
    index = choice["index"]
    if chat:
        text = (choice.get("delta") or choice.get("message") or {}).get("content") or ""
    else:
        text = choice.get("text") or ""
    result.texts[index] = result.texts.get(index, "") + text
    message = (choice.get("delta") or choice.get("message") or {}) if chat else {}
    for call in message.get("tool_calls") or []:  # whole, or streamed as OpenAI's deltas
        held = result.calls.setdefault(index, {}).setdefault(call.get("index", 0), ["", ""])
        held[0] += call.get("function", {}).get("name") or ""
        held[1] += call.get("function", {}).get("arguments") or ""
    if choice.get("finish_reason") is not None or index not in result.finish:
        result.finish[index] = choice.get("finish_reason")


def take_other_api(result: Result, api: str, payload: dict) -> None:
    """A whole Responses or Messages answer, or one of their stream's events, into the result (one
    choice: its text, its finish as chat names it, its usage)."""
    kind = payload.get("type", "response" if api == "responses" else "message")
    text = ""
    if kind in ("response", "response.completed", "response.incomplete"):
        response = payload.get("response", payload)
        if kind == "response":
            text = "".join(
                p.get("text", "") for i in response["output"] if i["type"] == "message" for p in i["content"]
            )
        result.finish[0] = "length" if response["status"] == "incomplete" else "stop"
        result.completion_tokens = response["usage"]["output_tokens"]
        result.done = True
    elif kind == "message":
        text = "".join(b.get("text", "") for b in payload["content"] if b["type"] == "text")
        result.finish[0] = "length" if payload["stop_reason"] == "max_tokens" else "stop"
        result.completion_tokens = payload["usage"]["output_tokens"]
        result.done = True
    elif kind == "response.output_text.delta":
        text = payload["delta"]
    elif kind == "content_block_delta":
        text = payload["delta"].get("text", "")
    elif kind == "message_delta":
        result.finish[0] = "length" if payload["delta"]["stop_reason"] == "max_tokens" else "stop"
        result.completion_tokens = payload["usage"]["output_tokens"]
    elif kind == "message_stop":
        result.done = True
    elif kind in ("error", "response.failed"):
        result.error = json.dumps(payload)[:500]
    result.texts[0] = result.texts.get(0, "") + text


async def plain(client: httpx.AsyncClient, spec: Spec, body: dict, result: Result) -> None:
    response = await client.post(spec.path, json=body)
    result.status = response.status_code
    if response.status_code != 200:
        result.error = response.text[:500]
        return
    payload = response.json()
    if spec.api != "openai":
        take_other_api(result, spec.api, payload)
        return
    if spec.kind == "embed":
        result.vectors = [item["embedding"] for item in payload["data"]]
        result.done = True
        return
    for choice in payload["choices"]:
        take_choice(result, choice, spec.chat)
    result.completion_tokens = payload["usage"]["completion_tokens"]
    result.done = True


async def streamed(client: httpx.AsyncClient, spec: Spec, body: dict, result: Result) -> None:
    async with client.stream("POST", spec.path, json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.error = (await response.aread()).decode(errors="replace")[:500]
            return
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result.done = True
                continue
            chunk = json.loads(line[6:])
            if spec.api != "openai":
                take_other_api(result, spec.api, chunk)
                chunks += 1
                if spec.drop_after is not None and chunks >= spec.drop_after:
                    result.dropped = True
                    return
                continue
            if "error" in chunk:
                result.error = json.dumps(chunk)[:500]
                continue
            for choice in chunk["choices"]:
                take_choice(result, choice, spec.chat)
            if chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
            chunks += 1
            if spec.drop_after is not None and chunks >= spec.drop_after:
                result.dropped = True  # leaving the `async with` closes the connection mid-stream
                return


async def send(
    client: httpx.AsyncClient | Clients,
    spec: Spec,
    timeout: float,
    stream: bool | None = None,
    cache_salt: str | None = None,
) -> Result:
    """One request (streamed as its spec says, unless `stream` is given); one that takes longer than
    `timeout` s is a hang. Embeddings go to the embeddings server's client."""
    if isinstance(client, Clients):
        client = client.embed if spec.kind == "embed" else client.generate
    result = Result(spec)
    body = spec.body(stream, cache_salt)
    start = time.monotonic()
    try:
        exchange = streamed(client, spec, body, result) if body.get("stream") else plain(client, spec, body, result)
        await asyncio.wait_for(exchange, timeout)
    except asyncio.TimeoutError:
        result.hang = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        result.error = f"client side: {type(exc).__name__}: {exc}"
    result.seconds = time.monotonic() - start
    return result


def incomplete(result: Result) -> str | None:
    """Why a kept request is not complete, or None."""
    spec = result.spec
    if result.hang:
        return "hang"
    if result.status != 200 or result.error:
        return f"status {result.status}: {result.error}"
    if not result.done:
        return "no [DONE]"
    if spec.kind == "embed":
        return bad_vectors(result.vectors, len(spec.prompt.split(" | ")))
    if sorted(result.finish) != list(range(spec.n)) or None in result.finish.values():
        return f"choices/finish reasons {result.finish}"
    if spec.ignore_eos and set(result.finish.values()) != {"length"}:
        return f"finish reasons {result.finish} with ignore_eos"
    if result.completion_tokens is None:
        return "no usage"
    if spec.ignore_eos and result.completion_tokens != spec.n * spec.max_tokens:
        return f"{result.completion_tokens} completion tokens, expected {spec.n * spec.max_tokens}"
    if spec.kind == "json":  # a choice cut short by max_tokens (the grammar allows any whitespace) is not judged
        return next(
            (
                why
                for i in range(spec.n)
                if result.finish.get(i) != "length" and (why := schema_error(result.texts.get(i, ""), SCHEMA))
            ),
            None,
        )
    if spec.kind == "tools":
        return bad_calls(result, spec)
    return None


def schema_error(text: str, schema: dict) -> str | None:
    """Why `text` is not JSON that holds to `schema`, or None."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        return f"not JSON under its schema: {type(exc).__name__}: {str(exc)[:200]} in {text[:200]!r}"
    return None


def bad_calls(result: Result, spec: Spec) -> str | None:
    """Why a tool request's choices are not each one valid call of an allowed tool, or None."""
    allowed = set(TOOL_SCHEMAS) if spec.tool_choice == "required" else {spec.tool_choice["function"]["name"]}
    for i in range(spec.n):
        if result.finish.get(i) == "length":  # cut short by max_tokens: no call to judge
            continue
        if result.finish.get(i) != "tool_calls":
            return f"choice {i} finished with {result.finish.get(i)!r}, not tool_calls"
        calls = list(result.calls.get(i, {}).values())
        if len(calls) != 1:
            return f"choice {i}: {len(calls)} calls (parallel_tool_calls is false)"
        name, arguments = calls[0]
        if name not in allowed:
            return f"choice {i}: a call of {name!r}, allowed {sorted(allowed)}"
        if (why := schema_error(arguments, TOOL_SCHEMAS[name])) is not None:
            return f"choice {i}: {why}"
    return None


def bad_vectors(vectors: list[list[float]] | None, count: int) -> str | None:
    """Why an embeddings answer is not `count` unit vectors of one size, or None."""
    if not vectors or len(vectors) != count or len({len(v) for v in vectors}) != 1:
        return f"{len(vectors or [])} vectors for {count} inputs, sizes {sorted({len(v) for v in vectors or []})}"
    norms = [sum(x * x for x in v) ** 0.5 for v in vectors]
    if any(abs(n - 1) > 1e-3 for n in norms):
        return f"norms {norms}"
    return None


# -- the soak and the greedy replay --------------------------------------------------------------
async def soak(client: Clients, specs: list[Spec], concurrency: int, timeout: float) -> list[Result]:
    """Workers take the next request as soon as their last one ends: `concurrency` always in flight."""
    results: list[Result | None] = [None] * len(specs)
    pending = iter(specs)

    async def worker() -> None:
        for spec in pending:  # a shared iterator: each spec is taken by one worker, once
            results[spec.index] = await send(client, spec, timeout)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None]


def greedy_kept(results: list[Result]) -> list[Result]:
    # Text requests (with images or not) only: a constrained one's pick at a bf16 near-tie has no text to locate it by.
    return [
        r
        for r in results
        if r.spec.greedy and r.spec.kind in ("text", "image") and not r.dropped and incomplete(r) is None
    ]


def split_siblings(results: list[Result]) -> list[Result]:
    """Greedy kept requests with n = 2 whose two samples differ (each is the same greedy sequence)."""
    return [r for r in greedy_kept(results) if r.spec.n == 2 and len(set(r.texts.values())) > 1]


def pick_replays(results: list[Result], count: int, seed: int) -> list[Result]:
    """Up to `count` greedy kept requests, taken in turn from each (endpoint, stream, n, long) group,
    and every n = 2 one whose samples differ (so that the replay judges where they part)."""
    groups: dict[tuple, list[Result]] = {}
    for r in greedy_kept(results):
        s = r.spec
        groups.setdefault((s.kind, s.api, s.chat, s.stream, s.n, s.long), []).append(r)
    rng = random.Random(seed)
    for members in groups.values():
        rng.shuffle(members)
    picked: list[Result] = []
    for round_ in range(count):
        picked += [members[round_] for _, members in sorted(groups.items()) if round_ < len(members)]
        if len(picked) >= count or all(round_ >= len(m) for m in groups.values()):
            break
    picked = picked[:count]
    return picked + [r for r in split_siblings(results) if all(r is not p for p in picked)]


def outputs(result: Result) -> tuple:
    return result.texts, result.finish, result.completion_tokens, result.calls


async def replay(client: Clients, picked: list[Result], timeout: float) -> tuple[int, list[dict]]:
    """Each picked request again, alone and non-streaming: how many answered, and the ones whose
    output differs, each with the gap (see `flip_gap`) at its first difference per choice."""
    answered, mismatches = 0, []
    for original in picked:
        # A salt of its own: no block cached by the soak or an earlier replay is hit, so that the
        # prompt is computed here, alone (in bf16, K/V computed in another batch rounds otherwise).
        alone = await send(client, original.spec, timeout, stream=False, cache_salt=f"replay-{original.spec.index}")
        answered += incomplete(alone) is None
        if outputs(alone) == outputs(original):
            continue
        gaps = await flip_gaps(client.generate, original, alone, timeout)
        mismatches.append(
            {
                "body": original.spec.body(),
                "in_soak": original.texts,
                "alone": alone.texts,
                "tokens_in_soak": original.completion_tokens,
                "tokens_alone": alone.completion_tokens,
                "alone_error": alone.error,
                "gaps": gaps,
            }
        )
    return answered, mismatches


def logprob_body(spec: Spec, k: int) -> dict:
    body = spec.body(stream=False, cache_salt=f"replay-logprobs-{spec.index}")
    body.update({"logprobs": True, "top_logprobs": k} if spec.chat else {"logprobs": k})
    return body


def token_steps(choice: dict, chat: bool) -> list[tuple[str, dict[str, float]]]:
    """(token text, {candidate text: logprob}) per generated token, from either endpoint's logprobs."""
    if chat:
        return [
            (e["token"], {t["token"]: t["logprob"] for t in e["top_logprobs"]} | {e["token"]: e["logprob"]})
            for e in choice["logprobs"]["content"]
        ]
    lp = choice["logprobs"]
    return list(zip(lp["tokens"], lp["top_logprobs"]))


def flip_gap(steps: list[tuple[str, dict[str, float]]], alone: str, soak: str) -> float | None:
    """At the first token where the soak's text leaves the alone run's: how many nats below the
    alone run's best candidate the soak's token sits (None: not among the alone run's top k).

    The soak's tokens are known only as text, so every alone step that touches the first differing
    character may be where the soak chose otherwise, and the smallest gap among them counts: one
    that ends right there (the soak took a longer token starting with it, "ns" for "n"), a special
    token the text leaves out (<|im_end|>, where the soak went on), and the one that crosses it."""
    common = next((i for i, (a, b) in enumerate(zip(alone, soak)) if a != b), min(len(alone), len(soak)))
    offset, gaps = 0, []
    for token, top in steps:
        in_text = alone.startswith(token, offset)
        end = offset + len(token) if in_text else offset  # a special token is no text
        if offset <= common <= end:
            rest = soak[offset:]
            crosses = end > common
            picks = [
                lp
                for candidate, lp in top.items()
                if candidate and rest.startswith(candidate) and (crosses or candidate != token)
            ]
            if picks:
                gaps.append(max(top.values()) - max(picks))
            if crosses:
                break
        offset = end
    return min(gaps) if gaps else None


async def flip_gaps(
    client: httpx.AsyncClient, original: Result, alone: Result, timeout: float, k: int = 5
) -> dict[int, float | None]:
    """The request alone once more, with top-k logprobs (which leave the tokens as they are): per
    differing choice, the gap at its first difference. A difference that rounding explains sits at
    a near-tie of the alone run; one that does not is a bug."""
    spec = original.spec
    response = await client.post(spec.path, json=logprob_body(spec, k), timeout=timeout)
    if response.status_code != 200:
        return {}
    gaps: dict[int, float | None] = {}
    for choice in response.json()["choices"]:
        index = choice["index"]
        text = choice["message"]["content"] if spec.chat else choice["text"]
        soak = original.texts.get(index, "")
        if text != alone.texts.get(index):  # not even the same alone twice
            gaps[index] = None
        elif text != soak:
            gaps[index] = flip_gap(token_steps(choice, spec.chat), text, soak)
    return gaps


def is_rounding_flip(mismatch: dict, margin: float) -> bool:
    """Every differing choice left at a near-tie (within `margin` nats), with the same token count
    where ignore_eos fixed it (else a flip also moves where the answer ends)."""
    gaps = mismatch["gaps"]
    same_length = mismatch["tokens_in_soak"] == mismatch["tokens_alone"] or not mismatch["body"].get("ignore_eos")
    return same_length and bool(gaps) and all(g is not None and g <= margin for g in gaps.values())


# -- the server: process, metrics, memory --------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lora_names(args: argparse.Namespace) -> list[str]:
    return [f"soak-lora-{i}" for i in range(args.lora_adapters)]


def write_adapters(args: argparse.Namespace) -> None:
    """--lora-adapters random PEFT adapters of the model, rank --lora-rank, into args.lora_paths."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import model_hf_config, write_lora_adapter
    from pagedllm.models.loader import default_model_path

    config = model_hf_config(args.model or default_model_path())
    root = tempfile.mkdtemp(prefix="pagedllm-soak-lora-")
    args.lora_paths = [
        write_lora_adapter(config, os.path.join(root, name), args.lora_rank, seed, scale=0.05)
        for seed, name in enumerate(lora_names(args))
    ]


def lora_server_args(args: argparse.Namespace) -> list[str]:
    """Every adapter but the last at start (the last is loaded at runtime); fewer in a step and in
    memory than there are, so that the scheduler's limit and the eviction both work."""
    if args.lora_fraction <= 0:
        return []
    modules = [f"{name}={path}" for name, path in zip(lora_names(args)[:-1], args.lora_paths)]
    return [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "2",
        "--max-lora-rank",
        str(args.lora_rank),
        "--lora-modules",
        *modules,
    ]


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve"]
    if args.model:
        command.append(args.model)
    command += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
        "--kv-cache-memory",
        args.kv_cache_memory,
    ]
    policy = ["--scheduling-policy", "priority"] if args.priority_fraction > 0 else []
    return command + lora_server_args(args) + policy + kv_offload_args(args) + shlex.split(args.extra_server_args)


def kv_offload_args(args: argparse.Namespace) -> list[str]:
    """The KV cache's disk tier in a fresh directory, small enough that its LRU evicts during the soak."""
    if not args.kv_offload:
        return []
    args.kv_offload_dir = tempfile.mkdtemp(prefix="pagedllm-soak-kv-")
    return ["--kv-offload-dir", args.kv_offload_dir, "--kv-offload-size", args.kv_offload_size]


def kv_offload_check(delta: dict[str, float]) -> tuple[str, bool, str]:
    """The disk tier was written and read, and every read it was asked for came back whole."""
    written, hits = (
        delta.get("pagedllm:kv_offload_write_blocks_total", 0),
        delta.get("pagedllm:kv_offload_hits_total", 0),
    )
    failures = delta.get("pagedllm:kv_offload_failures_total", 0)
    detail = f"{written:.0f} blocks written, {hits:.0f} read back, {failures:.0f} reads failed"
    return "KV disk tier written and read back", written > 0 and hits > 0 and failures == 0, detail


def embeddings_command(args: argparse.Namespace, port: int) -> list[str]:
    """The embeddings server beside the generation one (an engine serves one task): its model's
    prompts computed whole, so its own budget of batched tokens."""
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve"]
    if args.embeddings_model or args.model:
        command.append(args.embeddings_model or args.model)
    return command + [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--runner",
        "pooling",
        "--max-model-len",
        str(args.max_model_len),
        "--kv-cache-memory",
        "64MiB",
    ]


def start_server(command: list[str], log_path: str, url: str, wait: float) -> subprocess.Popen:
    """The server, once GET /health answers 200 (within `wait` s)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAGEDLLM_NO_PROGRESS": "1"}
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(process, 10)
    raise RuntimeError(f"the server did not become ready in {wait:.0f} s; see {log_path}")


def stop_server(process: subprocess.Popen, wait: float) -> int:
    """SIGTERM, then SIGKILL if it has not exited within `wait` s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    return process.returncode


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {name: value}, summed over labels (one model is served)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (\S+)$", line)
        if match:
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(2))
    return values


async def load_adapter(client: httpx.AsyncClient, name: str, path: str) -> None:
    """An adapter loaded at runtime (vLLM's route), as a client would before naming it."""
    response = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    if response.status_code != 200:
        raise RuntimeError(f"loading the LoRA adapter {name!r} at runtime: {response.status_code} {response.text}")


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    return parse_metrics((await client.get("/metrics")).text)


async def wait_idle(
    client: httpx.AsyncClient, wait: float, kv_usage: float | None = None
) -> tuple[dict[str, float], float | None]:
    """Metrics once nothing runs or waits (and, given `kv_usage`, the KV usage is back at it), and
    the seconds that took (None: not within `wait` s). An engine replica's stats come with its
    next message: the release of held blocks that ends a beam search shows a step later."""
    start = time.monotonic()
    while True:
        values = await metrics(client)
        idle = values["pagedllm:num_requests_running"] == 0 and values["pagedllm:num_requests_waiting"] == 0
        idle &= kv_usage is None or values["pagedllm:kv_cache_usage_perc"] == kv_usage
        elapsed = time.monotonic() - start
        if idle or elapsed > wait:
            return values, elapsed if idle else None
        await asyncio.sleep(0.25)


class RssSampler:
    """The server's resident memory (its children's too), every `interval` s, on a thread."""

    def __init__(self, pid: int, interval: float = 1.0, limit: int = 86_400) -> None:
        self.process, self.interval, self.limit = psutil.Process(pid), interval, limit
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> int:
        return sum(p.memory_info().rss for p in [self.process, *self.process.children(recursive=True)])

    def _run(self) -> None:
        while len(self.samples) < self.limit:
            try:
                self.samples.append(self._rss())
            except psutil.Error:  # the server is gone: the request checks say why
                return
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def rss_figures(samples: list[int]) -> dict[str, float]:
    """Start, midpoint and end RSS (MiB; medians of 10% windows) and the growth between the last two."""
    n = len(samples)
    if n == 0:
        return {"samples": 0, "start_mib": 0.0, "mid_mib": 0.0, "end_mib": 0.0, "max_mib": 0.0, "growth": 0.0}
    width = max(1, n // 10)
    mid = statistics.median(samples[max(0, n // 2 - width // 2) :][:width])
    end = statistics.median(samples[-width:])
    mib = 2**20
    return {
        "samples": n,
        "start_mib": samples[0] / mib,
        "mid_mib": mid / mib,
        "end_mib": end / mib,
        "max_mib": max(samples) / mib,
        "growth": end / mid - 1,
    }


# -- report --------------------------------------------------------------------------------------
def tally(results: list[Result]) -> dict:
    kept = [r for r in results if not r.dropped]
    statuses = Counter(r.status for r in results if r.status is not None)
    return {
        "sent": len(results),
        "dropped": sum(r.dropped for r in results),
        "drop_planned_but_finished": sum(r.spec.drop_after is not None and not r.dropped for r in results),
        "kept": len(kept),
        "kept_complete": sum(incomplete(r) is None for r in kept),
        "statuses": dict(sorted(statuses.items())),
        "hangs": sum(r.hang for r in results),
        "client_errors": sum(r.status is None and r.error is not None for r in results),
        "stream_error_events": sum(r.status == 200 and r.error is not None for r in results),
        "kept_output_tokens": sum(r.completion_tokens or 0 for r in kept),
    }


def mix(specs: list[Spec]) -> str:
    """The workload's composition, as counts."""
    kinds = {
        "chat": lambda s: s.chat,
        "streamed": lambda s: s.stream,
        "n=2": lambda s: s.n == 2,
        "greedy": lambda s: s.greedy,
        "seeded": lambda s: s.seed is not None,
        "long": lambda s: s.long,
        "ignore_eos": lambda s: s.ignore_eos,
        "drop planned": lambda s: s.drop_after is not None,
        "json": lambda s: s.kind == "json",
        "tools": lambda s: s.kind == "tools",
        "embeddings": lambda s: s.kind == "embed",
        "images": lambda s: s.kind == "image",
        "lora": lambda s: s.adapter is not None,
        "bad_words": lambda s: s.bad_words is not None,
        "priority": lambda s: s.priority != 0,
        "responses": lambda s: s.api == "responses",
        "messages": lambda s: s.api == "messages",
    }
    counts = ", ".join(f"{name} {sum(map(test, specs))}" for name, test in kinds.items())
    return f"{len(specs)} requests: {counts}"


def print_table(title: str, rows: list[tuple]) -> None:
    print(f"\n{title}\n\n| {' | '.join(map(str, rows[0]))} |\n|{'---|' * len(rows[0])}")
    for row in rows[1:]:
        print(f"| {' | '.join(map(str, row))} |")


def greedy_summary(replayed: int, answered: int, mismatches: list[dict], margin: float) -> dict:
    flips = [m for m in mismatches if is_rounding_flip(m, margin)]
    gaps = sorted(g for m in flips for g in m["gaps"].values())
    return {
        "replayed": replayed,
        "answered": answered,
        "equal": replayed - len(mismatches),
        "rounding_flips": len(flips),
        "flip_gaps": gaps,
        "other": len(mismatches) - len(flips),
    }


def greedy_check(g: dict, margin: float, strict: bool) -> tuple[str, bool, str]:
    ok = g["replayed"] > 0 and g["answered"] == g["replayed"] and g["other"] == 0
    ok = ok and not (strict and g["rounding_flips"])
    gaps = ", ".join(f"{x:.3f}" for x in g["flip_gaps"])
    detail = (
        f"{g['equal']}/{g['replayed']} equal, {g['rounding_flips']} rounding flips"
        f"{f' (gaps {gaps})' if gaps else ''}, {g['other']} other differences"
    )
    name = "greedy equals alone" + ("" if strict else f" (or differs first at a near-tie <= {margin} nats)")
    return name, ok, detail


def checks(
    t: dict, idle_s: float | None, kv: tuple[float, float], preemptions: float, greedy: tuple[str, bool, str], rss: dict
) -> list[tuple[str, bool, str]]:
    errors_5xx = sum(v for k, v in t["statuses"].items() if k >= 500)
    other = sum(v for k, v in t["statuses"].items() if k != 200)
    return [
        ("zero 5xx", errors_5xx == 0, f"{errors_5xx}"),
        (
            "no other error status, stream error event or client-side error",
            other == errors_5xx and t["stream_error_events"] == 0 and t["client_errors"] == 0,
            f"{other - errors_5xx} status, {t['stream_error_events']} events, {t['client_errors']} client",
        ),
        ("zero hangs", t["hangs"] == 0, f"{t['hangs']}"),
        ("every kept request complete", t["kept_complete"] == t["kept"], f"{t['kept_complete']}/{t['kept']}"),
        (
            "idle afterwards (running 0, waiting 0, KV usage back)",
            idle_s is not None,
            "never" if idle_s is None else f"after {idle_s:.2f} s",
        ),
        ("KV usage back at idle value", kv[1] == kv[0], f"before {kv[0]:.4f}, after {kv[1]:.4f}"),
        ("preemption happened", preemptions > 0, f"{preemptions:.0f} preemptions"),
        greedy,
        (
            "RSS growth over second half < 5%",
            rss["samples"] >= 10 and rss["growth"] < 0.05,
            f"{rss['growth'] * 100:+.2f}% ({rss['samples']} samples)",
        ),
    ]


def lora_check(results: list[Result], picked: list[Result], delta: dict[str, float]) -> tuple[str, bool, str]:
    """Every adapter request that completed is counted under its adapter in /metrics, and some of
    the greedy replays (the invariance check) ran under adapters."""
    done = sum(r.spec.adapter is not None and r.status == 200 and r.done and not r.dropped for r in results)
    counted = delta.get("pagedllm:lora_requests_total", 0.0)
    replayed = sum(r.spec.adapter is not None for r in picked)
    return (
        "LoRA requests counted per adapter, some replayed",
        counted >= done > 0 and replayed > 0,
        f"{done} completed, {counted:.0f} counted, {replayed} replayed alone",
    )


def report(t: dict, wall: float, delta: dict[str, float], rss: dict, results: list[Result]) -> None:
    hit_rate = delta["pagedllm:prefix_cache_hits_total"] / max(1.0, delta["pagedllm:prefix_cache_queries_total"])
    print_table(
        "Figures",
        [
            ("figure", "value"),
            ("requests sent", t["sent"]),
            ("kept (not dropped)", t["kept"]),
            ("kept and complete", t["kept_complete"]),
            ("dropped mid-stream", t["dropped"]),
            ("drop planned, stream ended first", t["drop_planned_but_finished"]),
            ("HTTP statuses", ", ".join(f"{k}: {v}" for k, v in t["statuses"].items())),
            ("hangs", t["hangs"]),
            ("wall time s", f"{wall:.1f}"),
            ("requests/s", f"{t['sent'] / wall:.2f}"),
            ("output tok/s (kept requests)", f"{t['kept_output_tokens'] / wall:.1f}"),
            ("output tok/s (server, all generated)", f"{delta['pagedllm:generation_tokens_total'] / wall:.1f}"),
            ("prompt tok/s (server, finished)", f"{delta['pagedllm:prompt_tokens_total'] / wall:.1f}"),
            ("preemptions during the run", f"{delta['pagedllm:num_preemptions_total']:.0f}"),
            ("prefix cache hit rate (prompt tokens)", f"{hit_rate:.1%}"),
            (
                "greedy n = 2 requests whose samples differ (all replayed)",
                f"{len(split_siblings(results))} of {sum(r.spec.n == 2 for r in greedy_kept(results))}",
            ),
            (
                "request latency median / max s",
                f"{statistics.median(r.seconds for r in results):.2f} / {max(r.seconds for r in results):.2f}",
            ),
            (
                "RSS start / mid / end / max MiB",
                f"{rss['start_mib']:.0f} / {rss['mid_mib']:.0f} / {rss['end_mib']:.0f} / {rss['max_mib']:.0f}",
            ),
            ("RSS growth, second half", f"{rss['growth'] * 100:+.2f}%"),
        ],
    )


def show_failures(results: list[Result], mismatches: list[dict], margin: float) -> None:
    """The first few of each kind of failure, with the request body, to reproduce them."""
    bad = [(r, incomplete(r)) for r in results if not r.dropped and incomplete(r) is not None]
    bad += [(r, r.error) for r in results if r.dropped and r.error]
    for r, why in bad[:10]:
        print(f"\nrequest {r.spec.index} {r.spec.path}: {why}\n  body: {json.dumps(r.spec.body())[:400]}")
    for m in mismatches[:10]:
        kind = "rounding flip" if is_rounding_flip(m, margin) else "GREEDY MISMATCH"
        print(f"\n{kind}:\n{json.dumps(m, indent=1)[:2000]}")


def server_checks(exit_code: int, log_path: str) -> list[tuple[str, bool, str]]:
    """A clean stop, and a log free of errors (a failure the client never saw still shows there)."""
    with open(log_path, errors="replace") as f:
        bad = [line.rstrip() for line in f if re.search(r"Traceback|\bERROR\b|\bCRITICAL\b", line)]
    for line in bad[:5]:
        print(f"server log: {line}")
    return [
        ("server exits 0 on SIGTERM", exit_code == 0, f"exit status {exit_code}"),
        ("no Traceback or ERROR in the server log", not bad, f"{len(bad)} lines"),
    ]


# -- main ----------------------------------------------------------------------------------------
def pair(value: str) -> tuple[int, int]:
    low, _, high = value.partition("-")
    return int(low), int(high or low)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: the default model)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--drop-fraction", type=float, default=0.25, help="of the streams")
    p.add_argument("--n2-fraction", type=float, default=0.3, help="requests with n = 2")
    p.add_argument("--long-fraction", type=float, default=0.4, help="requests with a long prompt")
    p.add_argument("--long-words", type=pair, default=(100, 300), help="a long prompt's words, LOW-HIGH")
    p.add_argument("--max-tokens", type=pair, default=(8, 64), help="LOW-HIGH")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="48MiB", help="small enough to force preemption")
    p.add_argument("--extra-server-args", default="", help="more `pagedllm serve` flags, one string")
    p.add_argument(
        "--mixed",
        action="store_true",
        help="every feature: -dp 2, n-gram speculation, the tool template, and the fractions below",
    )
    p.add_argument("--json-fraction", type=float, default=None, help="JSON-schema requests (--mixed: 0.15, else 0)")
    p.add_argument("--tools-fraction", type=float, default=None, help="tool-call requests (--mixed: 0.15, else 0)")
    p.add_argument("--beams-fraction", type=float, default=None, help="beam searches (--mixed: 0.05, else 0)")
    p.add_argument(
        "--embeddings-fraction",
        type=float,
        default=None,
        help="embeddings requests, to a second server (--mixed: 0.1, else 0)",
    )
    p.add_argument(
        "--embeddings-model",
        default=None,
        help="the embeddings server's model (default: the generation server's, --runner pooling)",
    )
    p.add_argument(
        "--images-fraction",
        type=float,
        default=0.0,
        help="chat requests with an image (a vision-language --model and a chat template that writes its placeholder)",
    )
    p.add_argument(
        "--lora-fraction",
        type=float,
        default=None,
        help="text and constrained requests under a LoRA adapter (--mixed: 0.2, else 0)",
    )
    p.add_argument(
        "--bad-words-fraction",
        type=float,
        default=None,
        help="text requests with bad_words (--mixed: 0.1, else 0)",
    )
    p.add_argument(
        "--priority-fraction",
        type=float,
        default=None,
        help="requests with a priority in -2..2, the server under --scheduling-policy priority (--mixed: 0.2, else 0)",
    )
    p.add_argument(
        "--api-fraction",
        type=float,
        default=None,
        help="plain chat requests sent through the Responses or the Messages API instead (--mixed: 0.2, else 0)",
    )
    p.add_argument(
        "--kv-offload",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the server keeps KV blocks on disk too (--kv-offload-dir, a fresh temporary directory; --mixed: on)",
    )
    p.add_argument("--kv-offload-size", default="256MiB", help="the disk tier's budget (--kv-offload)")
    p.add_argument("--lora-adapters", type=int, default=3, help="random PEFT adapters the server serves (>= 2)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="0: a free one")
    p.add_argument("--timeout", type=float, default=120.0, help="s a request may take before it counts as a hang")
    p.add_argument("--idle-wait", type=float, default=60.0, help="s for the server to go idle after the soak")
    p.add_argument("--replay", type=int, default=50, help="greedy requests resent alone afterwards")
    p.add_argument("--rss-interval", type=float, default=1.0, help="s between samples of the server's RSS")
    p.add_argument(
        "--tie-margin",
        type=float,
        default=0.3,
        help="nats: with --allow-rounding-flips, a greedy difference that starts where the alone run's best "
        "and the soak's pick are this close passes as rounding (the bf16 oracle test's EPS)",
    )
    p.add_argument(
        "--allow-rounding-flips",
        action="store_true",
        help="pass greedy differences at near-ties (configurations that are not batch-invariant: -tp in bf16)",
    )
    p.add_argument("--startup-wait", type=float, default=300.0)
    p.add_argument("--shutdown-wait", type=float, default=30.0)
    p.add_argument(
        "--log",
        default=os.path.join(tempfile.gettempdir(), "pagedllm-soak-server.log"),
        help="the server's stdout and stderr",
    )
    p.add_argument("--out", default=None, help="write figures and checks as JSON here")
    args = p.parse_args()
    for name, mixed in (
        ("json_fraction", 0.15),
        ("tools_fraction", 0.15),
        ("embeddings_fraction", 0.1),
        ("beams_fraction", 0.05),
        ("lora_fraction", 0.2),
        ("bad_words_fraction", 0.1),
        ("priority_fraction", 0.2),
        ("api_fraction", 0.2),
    ):
        if getattr(args, name) is None:
            setattr(args, name, mixed if args.mixed else 0.0)
    if args.kv_offload is None:
        args.kv_offload = args.mixed
    if args.mixed:
        args.extra_server_args = f"{MIXED_SERVER_ARGS} {args.extra_server_args}"
    if args.lora_fraction > 0 and args.lora_adapters < 2:
        p.error("--lora-adapters must be at least 2 (one is loaded at runtime)")
    return args


async def run(
    args: argparse.Namespace, url: str, pid: int, embed_url: str | None = None
) -> tuple[list[tuple[str, bool, str]], dict]:
    specs = make_workload(args)
    print(f"workload: {mix(specs)}")
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with (
        httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client,
        httpx.AsyncClient(base_url=embed_url or url, timeout=args.timeout, limits=limits) as embed_client,
    ):
        clients = Clients(client, embed_client)
        if args.lora_fraction > 0:
            await load_adapter(client, lora_names(args)[-1], args.lora_paths[-1])
        served = (await client.get("/v1/models")).json()["data"][0]["id"]
        for spec in specs:
            spec.model = served
        before = await metrics(client)
        start = time.monotonic()
        with RssSampler(pid, args.rss_interval) as sampler:
            results = await soak(clients, specs, args.concurrency, args.timeout)
        wall = time.monotonic() - start
        after, idle_s = await wait_idle(client, args.idle_wait, before["pagedllm:kv_cache_usage_perc"])
        embed_idle = (await wait_idle(embed_client, args.idle_wait))[1] if embed_url else 0.0
        picked = pick_replays(results, args.replay, args.seed)
        answered, mismatches = await replay(clients, picked, args.timeout)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    t, rss = tally(results), rss_figures(sampler.samples)
    kv = (before["pagedllm:kv_cache_usage_perc"], after["pagedllm:kv_cache_usage_perc"])
    report(t, wall, delta, rss, results)
    show_failures(results, mismatches, args.tie_margin)
    greedy = greedy_summary(len(picked), answered, mismatches, args.tie_margin)
    table = checks(
        t,
        idle_s,
        kv,
        delta["pagedllm:num_preemptions_total"],
        greedy_check(greedy, args.tie_margin, not args.allow_rounding_flips),
        rss,
    )
    if args.lora_fraction > 0:
        table.append(lora_check(results, picked, delta))
    if args.kv_offload:
        table.append(kv_offload_check(delta))
    if embed_url:
        table.append(
            (
                "embeddings server idle afterwards",
                embed_idle is not None,
                "never" if embed_idle is None else f"after {embed_idle:.2f} s",
            )
        )
    return table, {
        "tally": t,
        "wall_s": wall,
        "rss": rss,
        "metrics_delta": delta,
        "greedy": greedy,
        "mismatches": mismatches,
    }


def main() -> int:
    args = parse_args()
    if args.lora_fraction > 0:
        write_adapters(args)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    command = server_command(args, port)
    print(f"command: {shlex.join([sys.executable, *sys.argv])}\nserver:  {shlex.join(command)}\nlog:     {args.log}")
    process = start_server(command, args.log, url, args.startup_wait)
    embed_process, embed_url, embed_log = None, None, f"{args.log}.embeddings"
    try:
        if args.embeddings_fraction > 0:
            embed_port = free_port()
            embed_url = f"http://127.0.0.1:{embed_port}"
            embed_command = embeddings_command(args, embed_port)
            print(f"embeddings server: {shlex.join(embed_command)}\nlog:     {embed_log}")
            embed_process = start_server(embed_command, embed_log, embed_url, args.startup_wait)
        table, figures = asyncio.run(run(args, url, process.pid, embed_url))
    finally:
        code = stop_server(process, args.shutdown_wait)
        embed_code = stop_server(embed_process, args.shutdown_wait) if embed_process is not None else None
        if args.kv_offload:
            shutil.rmtree(args.kv_offload_dir, ignore_errors=True)
    table += server_checks(code, args.log)
    if embed_process is not None:
        table += [(f"embeddings {name}", ok, detail) for name, ok, detail in server_checks(embed_code, embed_log)]
    print_table("Checks", [("check", "result", "detail"), *((n, "pass" if ok else "FAIL", d) for n, ok, d in table)])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "checks": table, **figures, "server_exit": code}, f, indent=1)
    return 0 if all(ok for _, ok, _ in table) else 1


if __name__ == "__main__":
    sys.exit(main())
