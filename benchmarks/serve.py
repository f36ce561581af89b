"""Serving benchmark for any OpenAI-compatible server: streaming requests, Poisson arrivals.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 --input-len 128 \
        --output-len 128 --request-rate inf

With --launch, it starts `pagedllm serve` itself (default model) on a free port and stops it
after. Definitions follow vLLM's benchmark: TTFT is the time to the first streamed token; TPOT
is (latency - TTFT) / (output tokens - 1) per request; ITL is every gap between streamed chunks.
It also polls GET /health every 50 ms during the run and reports that latency, the measure of
whether the HTTP side stays responsive under load.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time

import httpx


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals, tokens = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    latency = time.perf_counter() - start
    ttft = arrivals[0] - start if arrivals else latency
    return {"ttft": ttft, "latency": latency, "tokens": tokens,
            "tpot": (latency - ttft) / (tokens - 1) if tokens > 1 else 0.0,
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:])]}


async def poll_health(client: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        start = time.perf_counter()
        await client.get("/health")
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.05)
    return latencies


async def run(args: argparse.Namespace, base_url: str) -> dict:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 20000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    limits = httpx.Limits(max_connections=args.num_prompts + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        stop = asyncio.Event()
        health = asyncio.create_task(poll_health(client, stop))
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, model, prompt, args.output_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        stop.set()
        health_latencies = await health
    return summarize(results, duration, health_latencies)


def summarize(results: list[dict], duration: float, health: list[float]) -> dict:
    def stats(values: list[float]) -> dict:
        values = sorted(values) or [0.0]
        return {"mean_ms": statistics.fmean(values) * 1000, "median_ms": statistics.median(values) * 1000,
                "p99_ms": values[min(len(values) - 1, int(len(values) * 0.99))] * 1000}

    output_tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "duration_s": duration, "request_throughput": len(results) / duration,
            "output_throughput": output_tokens / duration, "ttft": stats([r["ttft"] for r in results]),
            "tpot": stats([r["tpot"] for r in results]), "itl": stats([x for r in results for x in r["itl"]]),
            "e2e": stats([r["latency"] for r in results]), "health": stats(health),
            "health_max_ms": max(health, default=0.0) * 1000,
            "ttft_each_s": sorted(r["ttft"] for r in results)}


def launch(extra: list[str]) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port), *extra],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--launch", nargs=argparse.REMAINDER, default=None,
                        help="start `pagedllm serve` with these arguments instead of using --base-url")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    process = None
    base_url = args.base_url
    if args.launch is not None:
        process, base_url = launch(args.launch)
    try:
        result = asyncio.run(run(args, base_url))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    print("| requests | rate | req/s | output tok/s | TTFT mean/median/p99 ms | TPOT median ms | "
          "ITL median ms | E2E median s | /health median/max ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    r = result
    print(f"| {r['requests']} | {args.request_rate} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
          f"{r['ttft']['mean_ms']:.0f}/{r['ttft']['median_ms']:.0f}/{r['ttft']['p99_ms']:.0f} | "
          f"{r['tpot']['median_ms']:.1f} | {r['itl']['median_ms']:.1f} | {r['e2e']['median_ms'] / 1000:.2f} | "
          f"{r['health']['median_ms']:.1f}/{r['health_max_ms']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
