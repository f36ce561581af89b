"""Raw HTTP: SSE framing, OpenAI-shaped errors for bad input, and the server going on after each."""
from __future__ import annotations

import json

import httpx
import pytest

from server_utils import Server

KEY = "k3y"


@pytest.fixture(scope="module")
def server(llama_dir):
    server = Server(llama_dir, "--max-model-len", "128", "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
                    api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        yield client


GOOD = {"model": "tiny", "prompt": "Hello", "max_tokens": 3}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}

BAD = [
    ("bad json", "/v1/completions", b'{"prompt": "x", ', 400, None),
    ("wrong type", "/v1/completions", {**GOOD, "max_tokens": "5"}, 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens"),
    ("temperature > 2", "/v1/completions", {**GOOD, "temperature": 2.5}, 400, "temperature"),
    ("n = 0", "/v1/completions", {**GOOD, "n": 0}, 400, "n"),
    ("too-long prompt", "/v1/completions", {**GOOD, "prompt": "hello " * 200}, 400, "prompt"),
    ("prompt + max_tokens too long", "/v1/completions", {**GOOD, "prompt": "hi " * 20, "max_tokens": 120}, 400,
     "max_tokens"),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-9"}, 400, "model"),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("image content", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     None),
    ("token out of vocabulary", "/v1/completions", {**GOOD, "prompt": [1, 10**9]}, 400, "prompt"),
    ("logprobs too large", "/v1/completions", {**GOOD, "logprobs": 50}, 400, "logprobs"),
    ("bad logit_bias key", "/v1/completions", {**GOOD, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("empty prompt list", "/v1/completions", {**GOOD, "prompt": []}, 400, "prompt"),
]


def _post(http: httpx.Client, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"}, **kwargs)
    return http.post(path, json=body, **kwargs)


def _assert_error_shape(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("name, path, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error_then_server_goes_on(http, name, path, body, status, param):
    error = _assert_error_shape(_post(http, path, body), status)
    if param is not None:
        assert error["param"].startswith(param), error
    assert _post(http, "/v1/completions", GOOD).status_code == 200


def test_auth_unknown_route_and_oversized_body(server, http):
    _assert_error_shape(httpx.post(f"{server.url}/v1/completions", json=GOOD), 401)
    _assert_error_shape(httpx.post(f"{server.url}/v1/completions", json=GOOD,
                                   headers={"Authorization": "Bearer wrong"}), 401)
    _assert_error_shape(http.get("/v1/nothing-here"), 404)
    _assert_error_shape(_post(http, "/v1/completions", {**GOOD, "prompt": "x" * (9 * 1024 * 1024)}), 413)
    assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key
    assert _post(http, "/v1/completions", GOOD).status_code == 200


def test_sse_framing(http):
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "n": 2}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert {p["choices"][0]["index"] for p in payloads[:2]} == {0, 1}
    assert all(p["choices"][0]["delta"] == {"role": "assistant", "content": ""} for p in payloads[:2])
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 6
    for index in (0, 1):
        mine = [p["choices"][0] for p in payloads[:-1] if p["choices"][0]["index"] == index]
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["delta"] == {}


def test_tokenize_detokenize_version_metrics(http):
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 128
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"
    chat_tokens = http.post("/tokenize", json={"messages": CHAT["messages"]}).json()
    assert chat_tokens["count"] > tokens["count"]
    assert "version" in http.get("/version").json()
    metrics = http.get("/metrics").text
    for name in ["pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc",
                 "pagedllm:prefix_cache_queries_total", "pagedllm:prompt_tokens_total",
                 "pagedllm:generation_tokens_total", "pagedllm:time_to_first_token_seconds_bucket",
                 "pagedllm:inter_token_latency_seconds_bucket", "pagedllm:e2e_request_latency_seconds_count",
                 "pagedllm:request_queue_time_seconds_sum"]:
        assert name in metrics, name
