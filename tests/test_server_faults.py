"""Faults and limits, on the real server: a request that fails inside a step ends alone; an engine
that cannot go on says so and the process exits; SIGTERM drains; waiting and time are capped."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_utils import Server

FAULT_TOKEN = 4242  # PAGEDLLM_FAULT=token:ID: any step computing this token raises in the model runner
COMMON = ("--max-model-len", "256", "--kv-cache-memory", "16MiB")


def _complete(client: httpx.Client, prompt, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    return client.post("/v1/completions", json=body)


def _sse(client: httpx.Client, body: dict, path: str = "/v1/completions") -> list:
    """Every event of a stream, [DONE] as the string."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in response.iter_lines() if line]


@pytest.fixture(scope="module")
def faulty(llama_dir):
    server = Server(
        llama_dir, *COMMON, "--allowed-origins", "http://app.example", env={"PAGEDLLM_FAULT": f"token:{FAULT_TOKEN}"}
    )
    yield server
    server.stop()


def test_a_failing_request_ends_alone_and_the_others_go_on(faulty):
    good = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35]]
    with httpx.Client(base_url=faulty.url, timeout=60) as client:
        alone = [_complete(client, p).json()["choices"][0]["text"] for p in good]
        results: dict[int, httpx.Response] = {}

        def send(i: int, prompt) -> None:
            results[i] = _complete(client, prompt, max_tokens=24 if i < len(good) else 8)

        prompts = good + [[41, FAULT_TOKEN, 43]]
        threads = [threading.Thread(target=send, args=(i, p)) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bad = results[len(good)]
        assert bad.status_code == 500
        error = bad.json()["error"]
        assert error["type"] == "internal_server_error" and "injected fault" in error["message"]
        for i in range(len(good)):
            assert results[i].status_code == 200
            assert results[i].json()["choices"][0]["text"].startswith(alone[i])  # greedy: as when alone
        events = _sse(client, {"prompt": [7, FAULT_TOKEN], "max_tokens": 4})
        assert "injected fault" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
        assert client.get("/health").status_code == 200
        assert _complete(client, good[0]).json()["choices"][0]["text"] == alone[0]
        metrics = client.get("/metrics").text
        assert (
            "pagedllm:num_requests_running{" in metrics
            and 'pagedllm:num_requests_running{engine="0",model_name="' in metrics
        )


def test_cors_only_for_the_allowed_origins(faulty):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    allowed = httpx.options(f"{faulty.url}/v1/completions", headers={"Origin": "http://app.example", **preflight})
    assert allowed.headers.get("access-control-allow-origin") == "http://app.example"
    other = httpx.options(f"{faulty.url}/v1/completions", headers={"Origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers


def test_an_engine_that_cannot_go_on_fails_its_requests_and_the_process_exits(llama_dir):
    server = Server(llama_dir, *COMMON, env={"PAGEDLLM_FAULT": "fatal:3"})
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            events = _sse(client, {"prompt": "Hello", "max_tokens": 32, "ignore_eos": True})
            assert events[-1] == "[DONE]" and "engine has stopped" in events[-2]["error"]["message"]
            assert all("choices" in e for e in events[:-2])
        assert server.process.wait(timeout=60) != 0
    finally:
        server.stop()


SLOW = {"PAGEDLLM_FAULT": "slow:20"}  # 20 ms more a step: a 200-token request stays in flight for 4 s


def test_sigterm_lets_requests_in_flight_finish_and_refuses_new_ones(llama_dir):
    server = Server(llama_dir, *COMMON, "--shutdown-timeout", "60", env=SLOW)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            events: list = []
            body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
            reader = threading.Thread(target=lambda: events.extend(_sse(client, body)))
            reader.start()
            _wait_for(lambda: _gauge(client.get("/metrics").text, "num_requests_running") >= 1)
            server.process.send_signal(signal.SIGTERM)
            assert not events  # still in flight
            _wait_for(lambda: _refused(client))
            late = _complete(client, "too late")
            assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
            reader.join(timeout=120)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) > 100
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()


def test_sigterm_ends_what_outlives_the_grace_period_with_a_final_event(llama_dir):
    server = Server(llama_dir, *COMMON, "--shutdown-timeout", "0.5", env=SLOW)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            events: list = []
            body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True}
            reader = threading.Thread(target=lambda: events.extend(_sse(client, body)))
            reader.start()
            _wait_for(lambda: _gauge(client.get("/metrics").text, "num_requests_running") >= 1)
            server.process.send_signal(signal.SIGTERM)
            reader.join(timeout=120)
        assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()


def test_waiting_cap_and_request_timeout(llama_dir):
    server = Server(
        llama_dir, *COMMON, "--max-num-seqs", "1", "--max-waiting-requests", "2", "--request-timeout", "3", env=SLOW
    )
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            results: list[httpx.Response] = []
            lock = threading.Lock()

            def send() -> None:
                response = _complete(client, "Once upon a time", max_tokens=240)
                with lock:
                    results.append(response)

            threads = [threading.Thread(target=send) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            codes = sorted(r.status_code for r in results)
            refused = [r for r in results if r.status_code == 503]
            assert refused and all(r.headers.get("retry-after") == "1" for r in refused), codes
            timed_out = [r for r in results if r.status_code == 504]
            assert timed_out and all(r.json()["error"]["code"] == "request_timeout" for r in timed_out), codes
            assert set(codes) <= {503, 504}, codes  # 240 slow steps outlast 3 s
            _wait_for(lambda: _gauge(client.get("/metrics").text, "num_requests_waiting") == 0)
            events = _sse(client, {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True})
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
            _wait_for(lambda: _gauge(client.get("/metrics").text, "num_requests_running") == 0)
    finally:
        server.stop()


def test_a_taken_port_fails_before_the_model_loads(llama_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", llama_dir, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "KV cache" not in done.stderr and "Loading" not in done.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", llama_dir, "--port", "99999"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "not a TCP port" in bad.stderr


def _gauge(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f"pagedllm:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _refused(client: httpx.Client) -> bool:
    try:
        return client.get("/health").status_code == 503
    except httpx.HTTPError:
        return True


def _wait_for(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_clients_that_send_slowly_or_never_read_cannot_hold_the_engine(llama_dir):
    server = Server(llama_dir, *COMMON)
    try:
        host, port = "127.0.0.1", server.port
        body = json.dumps(
            {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        # One client stops half-way through its body; another asks for a long stream and never reads it.
        stalled = socket.create_connection((host, port))
        stalled.sendall(head + body[: len(body) // 2])
        deaf = socket.create_connection((host, port))
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        deaf.sendall(head + body)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for i in range(3):
                assert _complete(client, f"meanwhile {i}").status_code == 200
            # The unread stream is generated to its end (its chunks wait in buffers): nothing stays running.
            _wait_for(
                lambda: (
                    _gauge(client.get("/metrics").text, "num_requests_running") == 0
                    and _gauge(client.get("/metrics").text, "num_requests_waiting") == 0
                )
            )
            assert client.get("/health").status_code == 200
        stalled.close()
        deaf.close()
    finally:
        server.stop()
