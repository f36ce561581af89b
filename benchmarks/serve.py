"""Serving benchmark for any OpenAI-compatible server: streaming requests, Poisson arrivals.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 --input-len 128 \
        --output-len 128 --request-rate inf

With --launch, it starts `pagedllm serve` itself (default model) on a free port and stops it
after, and reports the server's resident memory (its RSS once ready, and the most it reached
during the run, sampled every 0.2 s). Definitions follow vLLM's benchmark: TTFT is the time to the first streamed token; TPOT
is (latency - TTFT) / (output tokens - 1) per request; ITL is every gap between streamed chunks
(with speculative decoding a chunk may carry several tokens: TPOT is the per-token figure).
It also polls GET /health every 50 ms during the run and reports that latency, the measure of
whether the HTTP side stays responsive under load.

The client is aiohttp, as vLLM's own: on a 2-core machine the client shares the CPUs with the
server it measures. An httpx client took 1.7 s of CPU in a 13 s run of the default command
against the 250M model, and our server gave 567-630 output tok/s under it; this one takes
0.6-0.8 s, and the same server gave 596-724 (each run a fresh server). The client's CPU seconds
are printed with the results.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import urllib.request

import aiohttp

GROUNDED = os.path.join(os.path.dirname(__file__), "data", "grounded_tasks.json")


async def one_request(client: aiohttp.ClientSession, model: str, prompt: list[int] | list[dict],
                      output_len: int) -> dict:
    """A streamed greedy request: a completion of token ids (EOS ignored), or a chat (it may end early)."""
    chat = isinstance(prompt[0], dict)
    body = {"model": model, "max_tokens": output_len, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    body.update({"messages": prompt} if chat else {"prompt": prompt, "ignore_eos": True})
    start = time.perf_counter()
    arrivals, tokens = [], 0
    async with client.post("/v1/chat/completions" if chat else "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:  # one SSE line at a time
            if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(raw[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choice = chunk["choices"][0] if chunk["choices"] else {}
            if choice.get("delta", {}).get("content") if chat else choice.get("text"):
                arrivals.append(time.perf_counter())
    latency = time.perf_counter() - start
    ttft = arrivals[0] - start if arrivals else latency
    return {"ttft": ttft, "latency": latency, "tokens": tokens,
            "tpot": (latency - ttft) / (tokens - 1) if tokens > 1 else 0.0,
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:])]}


async def poll_health(client: aiohttp.ClientSession, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        start = time.perf_counter()
        async with client.get("/health") as response:
            await response.read()
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.05)
    return latencies


async def run(args: argparse.Namespace, base_url: str) -> dict:
    rng = random.Random(args.seed)
    if args.dataset == "grounded":  # the input-grounded chats of benchmarks/spec_decode.py, in turn
        with open(GROUNDED) as f:
            tasks = json.load(f)
        prompts = [[{"role": "user", "content": f"{t['task']}\n\n{t['text']}"}]
                   for t in (tasks[i % len(tasks)] for i in range(args.num_prompts))]
    else:
        prompts = [[rng.randrange(1000, 20000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    connector = aiohttp.TCPConnector(limit=args.num_prompts + 8)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(base_url, connector=connector, timeout=timeout) as client:
        async with client.get("/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        stop = asyncio.Event()
        health = asyncio.create_task(poll_health(client, stop))
        tasks = []
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, model, prompt, args.output_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration, client_cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
        stop.set()
        health_latencies = await health
    return {**summarize(results, duration, health_latencies), "client_cpu_s": client_cpu}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                return process, url
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("server did not start")


class RssPeak:
    """The resident memory of a process: at start, and the most seen, sampled on a thread."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        import threading

        import psutil

        self.process, self.interval = psutil.Process(pid), interval
        self.ready = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except Exception:  # noqa: BLE001 - the server has exited
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--launch", nargs=argparse.REMAINDER, default=None,
                        help="start `pagedllm serve` with these arguments instead of using --base-url")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--dataset", choices=("random", "grounded"), default="random",
                        help="random: token-id prompts of --input-len, EOS ignored; grounded: the chats of "
                             "benchmarks/data/grounded_tasks.json (editing, quoting), ending where they end")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    process, sampler = None, None
    base_url = args.base_url
    if args.launch is not None:
        process, base_url = launch(args.launch)
        sampler = RssPeak(process.pid)
    try:
        result = asyncio.run(run(args, base_url))
    finally:
        if process is not None:
            sampler.stop()
            process.terminate()
            process.wait(timeout=60)
    if sampler is not None:
        result["rss_ready_mib"], result["rss_peak_mib"] = sampler.ready / 2**20, sampler.peak / 2**20
        print(f"server RSS: {result['rss_ready_mib']:.0f} MiB once ready, {result['rss_peak_mib']:.0f} MiB at most")
    print("| requests | rate | req/s | output tok/s | TTFT mean/median/p99 ms | TPOT median ms | "
          "ITL median ms | E2E median s | /health median/max ms | client CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    r = result
    print(f"| {r['requests']} | {args.request_rate} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
          f"{r['ttft']['mean_ms']:.0f}/{r['ttft']['median_ms']:.0f}/{r['ttft']['p99_ms']:.0f} | "
          f"{r['tpot']['median_ms']:.1f} | {r['itl']['median_ms']:.1f} | {r['e2e']['median_ms'] / 1000:.2f} | "
          f"{r['health']['median_ms']:.1f}/{r['health_max_ms']:.1f} | {r['client_cpu_s']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
