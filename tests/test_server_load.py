"""Bounded load: 64 concurrent streams, a quarter of the clients leaving mid-stream."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from server_utils import Server

STREAMS = 64
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(llama_dir):
    server = Server(llama_dir, "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--block-size", "4")
    yield server
    server.stop()


async def _stream(client: httpx.AsyncClient, i: int, leave_after: int | None) -> dict:
    body = {
        "prompt": f"Request number {i} says",
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    chunks, done = [], False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                done = True
                continue
            chunks.append(json.loads(line[6:]))
            if leave_after is not None and len(chunks) >= leave_after:
                return {"left": True}
    return {"left": False, "chunks": chunks, "done": done}


async def _health_latencies(url: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            start = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)
    return latencies


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))


def _success(text: str, reason: str) -> float:
    found = re.search(rf'^pagedllm:request_success_total{{[^}}]*finished_reason="{reason}"[^}}]*}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_64_streams_with_disconnects(server):
    async def main():
        stop = asyncio.Event()
        health = asyncio.create_task(_health_latencies(server.url, stop))
        limits = httpx.Limits(max_connections=STREAMS + 4)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            results = await asyncio.gather(*[_stream(client, i, 3 if i % 4 == 0 else None) for i in range(STREAMS)])
        stop.set()
        return results, await health

    started = time.perf_counter()
    results, latencies = asyncio.run(main())
    elapsed = time.perf_counter() - started
    complete = [r for r in results if not r["left"]]
    assert len(complete) == STREAMS * 3 // 4
    for result in complete:
        assert result["done"]
        choices = [c["choices"][0] for c in result["chunks"]]
        assert [c["finish_reason"] for c in choices][-1] == "length"
        assert all(c["finish_reason"] is None for c in choices[:-1])
    assert latencies  # every /health probe during the load answered 200 (asserted as it came)
    latencies.sort()
    print(
        f"\n{STREAMS} streams in {elapsed:.1f}s; /health latency under load: median "
        f"{latencies[len(latencies) // 2] * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms, n={len(latencies)}"
    )
    # The aborted requests' blocks come back: nothing running, every block free.
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(f"{server.url}/metrics").text
        idle = (
            _metric(metrics, "pagedllm:num_requests_running") == 0
            and _metric(metrics, "pagedllm:num_requests_waiting") == 0
            and _metric(metrics, "pagedllm:kv_cache_usage_perc") == 0
        )
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, metrics
    assert _metric(metrics, "pagedllm:generation_tokens_total") >= len(complete) * MAX_TOKENS
    # Each client that left counts as an aborted request (unless its request had finished by the
    # time the server saw it go), the others by their finish reason.
    aborted, finished = _success(metrics, "abort"), _success(metrics, "length")
    assert aborted + finished == STREAMS and 0 < aborted <= STREAMS - len(complete), metrics
