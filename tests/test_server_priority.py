"""--scheduling-policy priority on a real server: a more urgent request (a lower `priority`) sent
while a long one holds the only sequence slot preempts it and finishes first."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from openai import OpenAI

from server_utils import Server


@pytest.fixture(scope="module")
def server(llama_dir):
    server = Server(
        llama_dir,
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "16MiB",
        "--max-num-seqs",
        "1",
        "--scheduling-policy",
        "priority",
        "--served-model-name",
        "tiny",
    )
    yield server
    server.stop()


def _preemptions(server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("pagedllm:num_preemptions_total")
    )


def test_a_lower_priority_value_preempts_and_finishes_first(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    finished: dict[str, float] = {}
    started = threading.Event()

    def long_request() -> None:
        stream = client.completions.create(
            model="tiny",
            prompt="Once upon a time",
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "priority": 10},
        )
        for _ in stream:
            started.set()
        finished["long"] = time.monotonic()

    before = _preemptions(server)
    thread = threading.Thread(target=long_request)
    thread.start()
    assert started.wait(60)
    urgent = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=5, temperature=0, extra_body={"ignore_eos": True, "priority": -1}
    )
    finished["urgent"] = time.monotonic()
    thread.join(120)
    assert urgent.usage.completion_tokens == 5
    assert finished["urgent"] < finished["long"]
    assert _preemptions(server) > before
    # Priority within one level is arrival order: equal priorities never preempt.
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={"priority": 10}).choices
