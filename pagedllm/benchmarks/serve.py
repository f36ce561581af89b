"""`pagedllm bench serve`: streaming requests against any OpenAI-compatible server, Poisson arrivals.

    pagedllm bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --random-input-len 128 \
        --random-output-len 128 --request-rate inf --ignore-eos

Definitions follow vLLM's benchmark: TTFT is the time to the first streamed token; TPOT is
(latency - TTFT) / (output tokens - 1) per request; ITL is every gap between streamed chunks (with
speculative decoding a chunk may carry several tokens: TPOT is the per-token figure). It also polls
GET /health every 50 ms during the run and reports that latency: whether the HTTP side stays
responsive under load. Random prompts are token ids (completions) drawn from --random-token-range,
or words (chat); with --random-range-ratio R each request's input and output lengths are drawn
from [len x (1 - R), len x (1 + R)], as vLLM's. Percentiles interpolate linearly between ranks (as
numpy's, which vLLM's client uses). The client is aiohttp, as vLLM's own (imported when a run
starts): on a small machine the client shares the CPUs with the server it measures; its CPU
seconds are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import time
from dataclasses import dataclass

from tqdm import tqdm

from pagedllm.config import positive

Prompt = list[int] | list[dict]  # token ids (completions) or messages (chat)
_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "number group problem fact"
).split()


@dataclass
class ServeConfig:
    base_url: str
    model: str | None = None  # None: the first the server lists
    backend: str = "openai"  # one of BACKENDS: the route and the shape of its stream
    endpoint: str | None = None  # None: the backend's
    request_rate: float = float("inf")  # requests a second (Poisson), inf: all at once
    max_concurrency: int | None = None
    ignore_eos: bool = False  # vLLM's extension: every request generates its output length
    api_key: str | None = None
    seed: int = 0
    progress: bool = True

    @property
    def chat(self) -> bool:
        """Prompts as messages (every backend but completions')."""
        return self.backend not in ("openai", "vllm")


# Each backend's route: completions (token-id prompts), chat, OpenAI's Responses, Anthropic's Messages.
BACKENDS = {
    "openai": "/v1/completions",
    "vllm": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
    "openai-responses": "/v1/responses",
    "anthropic-messages": "/v1/messages",
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's names; the older names of benchmarks/serve.py work too."""
    parser.add_argument("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000 (else --host, --port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--backend",
        choices=list(BACKENDS),
        default="openai",
        help="openai/vllm: /v1/completions with token-id prompts; openai-chat: /v1/chat/completions; "
        "openai-responses: /v1/responses; anthropic-messages: /v1/messages",
    )
    parser.add_argument("--endpoint", default=None, help="the path requests go to (default: the backend's)")
    parser.add_argument("--model", default=None, help="the served model's name (default: the first /v1/models lists)")
    parser.add_argument("--dataset-name", "--dataset", dest="dataset_name", choices=("random",), default="random")
    parser.add_argument("--num-prompts", type=positive(int), default=64)
    parser.add_argument("--random-input-len", "--input-len", dest="random_input_len", type=positive(int), default=128)
    parser.add_argument(
        "--random-output-len", "--output-len", dest="random_output_len", type=positive(int), default=128
    )
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="input and output lengths drawn from [len x (1 - R), len x (1 + R)] (0: all equal)",
    )
    parser.add_argument(
        "--random-token-range",
        type=int,
        nargs=2,
        default=(1000, 20000),
        metavar=("LOW", "HIGH"),
        help="token ids of random prompts are drawn from [LOW, HIGH)",
    )
    parser.add_argument(
        "--request-rate",
        type=positive(float),
        default=float("inf"),
        help="requests a second (Poisson); inf: all at once",
    )
    parser.add_argument(
        "--max-concurrency", type=positive(int), default=None, help="at most this many requests in flight"
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="ask each request to generate all its tokens (vLLM's extension)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    parser.add_argument(
        "--metric-percentiles",
        type=_percentiles,
        default=[99.0],
        help="comma-separated percentiles to report, e.g. 50,90,99",
    )
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--save-result", action="store_true", help="write the results as JSON (--result-filename)")
    parser.add_argument("--result-filename", "--out", dest="result_filename", default=None)


def _percentiles(value: str) -> list[float]:
    try:
        chosen = [float(p) for p in value.split(",") if p.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: comma-separated numbers, e.g. 50,90,99") from exc
    if not chosen or not all(0 < p <= 100 for p in chosen):
        raise argparse.ArgumentTypeError(f"{value!r}: percentiles in (0, 100]")
    return chosen


def config_from_args(ns: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        ns.base_url or f"http://{ns.host}:{ns.port}",
        ns.model,
        ns.backend,
        ns.endpoint,
        ns.request_rate,
        ns.max_concurrency,
        ns.ignore_eos,
        ns.api_key,
        ns.seed,
        not ns.disable_tqdm,
    )


def random_requests(ns: argparse.Namespace, chat: bool) -> list[tuple[Prompt, int]]:
    """(prompt, output length) pairs: token ids, or for chat words (about a token each)."""
    rng = random.Random(ns.seed)
    low, high = ns.random_token_range
    ratio = ns.random_range_ratio

    def length(center: int) -> int:
        return max(1, rng.randint(int(center * (1 - ratio)), int(center * (1 + ratio))))

    requests = []
    for _ in range(ns.num_prompts):
        n_in, n_out = length(ns.random_input_len), length(ns.random_output_len)
        prompt = (
            [{"role": "user", "content": " ".join(rng.choice(_WORDS) for _ in range(n_in))}]
            if chat
            else [rng.randrange(low, high) for _ in range(n_in)]
        )
        requests.append((prompt, n_out))
    return requests


def request_body(config: ServeConfig, model: str, prompt: Prompt, output_len: int) -> dict:
    """A streamed greedy request of the backend's shape."""
    body: dict = {"model": model, "stream": True, "temperature": 0}
    if config.backend == "openai-responses":
        body.update(input=prompt, max_output_tokens=output_len)
    elif config.backend == "anthropic-messages":
        body.update(messages=prompt, max_tokens=output_len)
    else:
        body.update({"messages": prompt} if config.chat else {"prompt": prompt})
        body.update(max_tokens=output_len, stream_options={"include_usage": True})
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


@dataclass
class _Progress:
    """What a stream told so far: token arrivals, usage (prompt_tokens, completion_tokens), its end."""

    arrivals: list[float]
    usage: dict
    done: bool = False
    error: str | None = None


def read_event(config: ServeConfig, data: bytes, progress: _Progress) -> None:
    """One SSE data line of the backend's stream."""
    if config.backend in ("openai", "vllm", "openai-chat"):
        if data.startswith(b"[DONE]"):
            progress.done = True
            return
        chunk = json.loads(data)
        if chunk.get("error"):
            progress.error = str(chunk["error"].get("message", chunk["error"]))[:200]
            return
        progress.usage = chunk.get("usage") or progress.usage
        choice = chunk["choices"][0] if chunk.get("choices") else {}
        if choice.get("delta", {}).get("content") if config.chat else choice.get("text"):
            progress.arrivals.append(time.perf_counter())
        return
    event = json.loads(data)
    kind = event.get("type", "")
    if kind in ("error", "response.failed"):
        error = event.get("error") or event.get("response", {}).get("error") or event
        progress.error = str(error.get("message", error) if isinstance(error, dict) else error)[:200]
    elif kind in ("response.output_text.delta", "response.reasoning_text.delta") or (
        kind == "content_block_delta" and (event["delta"].get("text") or event["delta"].get("thinking"))
    ):
        progress.arrivals.append(time.perf_counter())
    elif kind in ("response.completed", "response.incomplete"):
        usage = event["response"]["usage"]
        progress.usage = {"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"]}
        progress.done = True
    elif kind == "message_start":
        progress.usage = {"prompt_tokens": event["message"]["usage"]["input_tokens"]}
    elif kind == "message_delta":
        progress.usage["completion_tokens"] = event["usage"]["output_tokens"]
    elif kind == "message_stop":
        progress.done = True


async def one_request(client, config: ServeConfig, model: str, prompt: Prompt, output_len: int) -> dict:
    """A streamed greedy request; its timings, or its error (a stream that ends without its end
    event, [DONE] or the API's own, included)."""
    import aiohttp

    body = request_body(config, model, prompt, output_len)
    path = config.endpoint or BACKENDS[config.backend]
    headers = {"x-api-key": config.api_key or "", "anthropic-version": "2023-06-01"}
    start = time.perf_counter()
    progress = _Progress([], {})
    try:
        async with client.post(path, json=body, headers=headers) as response:
            if response.status != 200:
                return {"error": f"HTTP {response.status}: {(await response.text())[:200]}"}
            async for raw in response.content:  # one SSE line at a time
                if raw.startswith(b"data: ") and not progress.done:
                    read_event(config, raw[6:], progress)
                if progress.error is not None:
                    return {"error": progress.error}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, AttributeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}  # the server went away, or sent what is not a stream
    if not progress.done:
        return {"error": "the stream ended without its end event"}
    arrivals, usage = progress.arrivals, progress.usage
    latency = time.perf_counter() - start
    ttft = arrivals[0] - start if arrivals else latency
    tokens = usage.get("completion_tokens") or len(arrivals)  # a server that sends no usage: a chunk a token
    prompt_tokens = usage.get("prompt_tokens") or (len(prompt) if not config.chat else 0)
    return {
        "ttft": ttft,
        "latency": latency,
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "tpot": (latency - ttft) / (tokens - 1) if tokens > 1 else None,
        "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
    }


async def _poll_health(client, stop: asyncio.Event) -> list[float]:
    import aiohttp

    latencies = []
    while not stop.is_set():
        start = time.perf_counter()
        try:
            async with client.get("/health") as response:
                await response.read()
        except aiohttp.ClientError:
            return latencies  # a server without /health
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.05)
    return latencies


async def benchmark(config: ServeConfig, requests: list[tuple[Prompt, int]]) -> dict:
    """Send every (prompt, output length) at the configured rate and concurrency; summarize the timings."""
    import aiohttp

    rng = random.Random(config.seed)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connector = aiohttp.TCPConnector(limit=len(requests) + 8)
    gate = asyncio.Semaphore(config.max_concurrency or len(requests) or 1)
    bar = tqdm(total=len(requests), disable=not config.progress, desc="requests")
    async with aiohttp.ClientSession(
        config.base_url, connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=3600)
    ) as client:
        model = config.model or await _first_model(client, config.base_url)

        async def limited(prompt: Prompt, output_len: int) -> dict:
            async with gate:
                result = await one_request(client, config, model, prompt, output_len)
            bar.update()
            return result

        stop = asyncio.Event()
        health = asyncio.create_task(_poll_health(client, stop))
        tasks = []
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        for prompt, output_len in requests:
            tasks.append(asyncio.create_task(limited(prompt, output_len)))
            if config.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(config.request_rate))
        results = await asyncio.gather(*tasks)
        duration, client_cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
        stop.set()
        health_latencies = await health
    bar.close()
    return {**summarize(results, duration, health_latencies), "client_cpu_s": client_cpu, "model": model}


async def _first_model(client, base_url: str) -> str:
    """The first model the server lists; a ValueError saying why where there is none to ask."""
    import aiohttp

    try:
        async with client.get("/v1/models") as response:
            if response.status != 200:
                raise ValueError(
                    f"{base_url}/v1/models answered {response.status}: "
                    f"{(await response.text())[:200]} (--model names the model; --api-key)"
                )
            return (await response.json())["data"][0]["id"]
    except aiohttp.ClientError as exc:
        raise ValueError(f"cannot reach the server at {base_url}: {exc}") from exc


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _stats(values: list[float]) -> dict:
    ordered = sorted(values) or [0.0]
    return {
        "mean_ms": statistics.fmean(ordered) * 1000,
        "median_ms": statistics.median(ordered) * 1000,
        "p99_ms": percentile(ordered, 99) * 1000,
        "values_s": ordered,
    }


def percentile(ordered: list[float], p: float) -> float:
    """The p-th percentile of sorted values, interpolated linearly between ranks (numpy's default)."""
    if not ordered:
        return 0.0
    position = (len(ordered) - 1) * p / 100
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def summarize(results: list[dict], duration: float, health: list[float]) -> dict:
    done = [r for r in results if "error" not in r]
    output_tokens = sum(r["tokens"] for r in done)
    input_tokens = sum(r["prompt_tokens"] for r in done)
    return {
        "requests": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
        "duration_s": duration,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft": _stats([r["ttft"] for r in done]),
        "tpot": _stats([r["tpot"] for r in done if r["tpot"] is not None]),  # (as vLLM: 2 tokens or more)
        "itl": _stats([x for r in done for x in r["itl"]]),
        "e2e": _stats([r["latency"] for r in done]),
        "health": _stats(health),
        "health_max_ms": max(health, default=0.0) * 1000,
    }


def print_results(result: dict, percentiles: list[float]) -> None:
    width = 50
    print(" Serving benchmark ".center(width, "="))
    rows = [
        ("Successful requests", result["requests"]),
        ("Failed requests", result["failed"]),
        ("Duration (s)", f"{result['duration_s']:.2f}"),
        ("Input tokens", result["input_tokens"]),
        ("Output tokens", result["output_tokens"]),
        ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{result['output_throughput']:.1f}"),
        ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.1f}"),
    ]
    for name, label in (
        ("ttft", "Time to first token"),
        ("tpot", "Time per output token (excl. 1st)"),
        ("itl", "Inter-token latency"),
        ("e2e", "End-to-end latency"),
        ("health", "/health latency"),
    ):
        rows.append((f"-- {label} --", ""))
        stats = result[name]
        rows += [
            (f"Mean {name.upper()} (ms)", f"{stats['mean_ms']:.2f}"),
            (f"Median {name.upper()} (ms)", f"{stats['median_ms']:.2f}"),
        ]
        rows += [(f"P{p:g} {name.upper()} (ms)", f"{percentile(stats['values_s'], p) * 1000:.2f}") for p in percentiles]
    rows.append(("Client CPU (s)", f"{result['client_cpu_s']:.2f}"))
    for name, value in rows:
        print(f"{name:<36}{value:>14}" if value != "" else name.center(width))
    for error in result["errors"]:
        print(f"error: {error}")
    print("=" * width)


def main(ns: argparse.Namespace, requests: list[tuple[Prompt, int]] | None = None) -> dict:
    config = config_from_args(ns)
    requests = requests if requests is not None else random_requests(ns, config.chat)
    result = asyncio.run(benchmark(config, requests))
    print_results(result, ns.metric_percentiles)
    if ns.save_result or ns.result_filename:
        path = ns.result_filename or f"serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result
