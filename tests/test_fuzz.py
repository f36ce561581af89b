"""Fuzzing every route of the real server from its own OpenAPI schema (schemathesis): whatever the
body, valid by the schema or not, no 5xx, and every 4xx in OpenAI's error shape. A short run here;
`PAGEDLLM_FUZZ_EXAMPLES=500 pytest tests/test_fuzz.py` is the longer one (BENCHMARKS.md)."""
from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_utils import Server

EXAMPLES = int(os.environ.get("PAGEDLLM_FUZZ_EXAMPLES", "20"))
STATUSES: Counter = Counter()  # (route, status) -> requests, printed at the end (pytest -s)
ROUTES = ["POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings", "POST /tokenize",
          "POST /detokenize", "GET /v1/models", "GET /health", "GET /version", "GET /metrics"]


@pytest.fixture(scope="module")
def fuzz_server(llama_dir):
    # A short context keeps what a generated request may ask for (n x max_tokens) small.
    server = Server(llama_dir, "--max-model-len", "64", "--kv-cache-memory", "16MiB", "--served-model-name", "tiny")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


def test_every_route_is_fuzzed(api_schema):
    found = {f"{op.ok().method.upper()} {op.ok().path}" for op in api_schema.get_all_operations()}
    assert found == set(ROUTES)


# Invalid inputs (negative mode) exist only where a route takes a body.
CASES = [(route, mode) for route in ROUTES for mode in schemathesis.GenerationMode
         if route.startswith("POST") or mode == schemathesis.GenerationMode.POSITIVE]


@pytest.mark.parametrize("route, mode", CASES, ids=[f"{r}-{m.value}" for r, m in CASES])
def test_no_5xx_and_every_4xx_in_openai_shape(route, mode, api_schema, fuzz_server):
    method, path = route.split()
    operation = api_schema[path][method]

    # The plugin's own parametrize does not run under this pytest; a plain hypothesis test does.
    # Half the bodies drop their random `model`, which would otherwise stop nearly every request at the
    # model check before any deeper code runs.
    @given(case=operation.as_strategy(generation_mode=mode), any_model=st.booleans())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case, any_model: bool) -> None:
        if not any_model and isinstance(case.body, dict):
            case.body.pop("model", None)
        response = case.call(base_url=fuzz_server.url, timeout=120)
        STATUSES[route, response.status_code] += 1
        assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
        if response.status_code >= 400:
            error = response.json().get("error")
            assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, response.text
            assert isinstance(error["message"], str) and error["message"]

    check()
    assert fuzz_server.process.poll() is None, "the server died under fuzzing"


def test_the_server_still_serves_after_fuzzing(fuzz_server):
    print(f"\nfuzzed: {sum(STATUSES.values())} requests;", ", ".join(f"{r} {c}: {n}" for (r, c), n in
                                                               sorted(STATUSES.items())))
    body = {"prompt": "Hello", "max_tokens": 3, "model": "tiny"}
    assert httpx.post(f"{fuzz_server.url}/v1/completions", json=body, timeout=60).status_code == 200
    assert httpx.get(f"{fuzz_server.url}/health").status_code == 200
