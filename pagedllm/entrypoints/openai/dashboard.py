"""The live dashboard: `GET /dashboard` (one static page, no external assets) and the JSON it polls,
`GET /dashboard/state`.

The state is each engine replica's snapshot (core/snapshot.py: block pool, queues, last steps),
taken between steps when the page asks, and the frontend's counters over the last minutes, sampled
every second from the same registry `/metrics` renders, so the two agree. The page holds no data:
it is served without the API key; the state needs the key when one is set (the page asks for it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import deque
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from pagedllm.config import text_config
from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.entrypoints.openai.protocol import APIError
from pagedllm.entrypoints.openai.serving import off_loop

HISTORY_S = 600  # seconds of counters the page can plot
SAMPLE_EVERY_S = 1.0
# The frontend's cumulative series the page turns into rates and means: name -> Prometheus sample.
_SERIES = {
    "generation_tokens": "pagedllm:generation_tokens_total",
    "prompt_tokens": "pagedllm:prompt_tokens_total",
    "ttft_sum": "pagedllm:time_to_first_token_seconds_sum",
    "ttft_count": "pagedllm:time_to_first_token_seconds_count",
    "itl_sum": "pagedllm:inter_token_latency_seconds_sum",
    "itl_count": "pagedllm:inter_token_latency_seconds_count",
    "e2e_count": "pagedllm:e2e_request_latency_seconds_count",
}


class CounterHistory:
    """The frontend's counters and the engine's running totals, one sample a second, for HISTORY_S."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.samples: deque[dict] = deque(maxlen=int(HISTORY_S / SAMPLE_EVERY_S))

    def read(self) -> dict:
        """The counters now (as /metrics would render them)."""
        registry, labels = self.engine.metrics.registry, {"model_name": self.engine.metrics.model_name}
        row = {name: registry.get_sample_value(sample, labels) or 0.0 for name, sample in _SERIES.items()}
        stats = self.engine.stats
        row.update(
            time=time.time(),
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            spec_num_draft_tokens=stats.spec_num_draft_tokens,
            spec_num_accepted_tokens=stats.spec_num_accepted_tokens,
            num_preemptions=stats.num_preemptions,
        )
        return row

    async def run(self) -> None:
        while True:
            self.samples.append(self.read())
            await asyncio.sleep(SAMPLE_EVERY_S)


def install_dashboard(app: FastAPI, engine: AsyncLLM, model_name: str) -> CounterHistory:
    """The two routes; the caller runs the returned history's `run()` while serving."""
    history = CounterHistory(engine)
    config = engine.model_config
    embedding_bytes = text_config(config.hf_config).hidden_size * (4 if config.dtype == "float32" else 2)
    page = resources.files(__package__).joinpath("dashboard.html").read_text()

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard():
        return HTMLResponse(page)

    @app.get("/dashboard/state")
    async def dashboard_state():
        try:
            snapshots = await engine.snapshots()
        except (EngineDeadError, asyncio.TimeoutError) as exc:
            raise APIError(f"no snapshot from the engine: {exc!r}", 503, "service_unavailable") from exc
        state = {
            "model": model_name,
            "time": time.time(),
            "replicas": [dataclasses.asdict(s) for s in snapshots],
            "embedding_bytes": embedding_bytes,  # an encoder cache row's (an image token's embedding)
            "counters": history.read(),
            "history": list(history.samples),
        }
        return Response(await off_loop(json.dumps, state), media_type="application/json")

    return history
