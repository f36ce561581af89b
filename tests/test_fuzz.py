"""Fuzzing every route of the real server from its own OpenAPI schema (schemathesis): whatever the
body, valid by the schema or not, no 5xx, and every 4xx in its API's error shape (OpenAI's; Anthropic's on
/v1/messages). The server runs
with every feature a request can reach: tool calls (auto, with the hermes parser and template),
reasoning, n-gram speculation, structured output (always on), embeddings (a decoder serves them)
and the dashboard. Two phases: schemathesis' coverage phase (deterministic boundary and
missing-field cases of every schema) and random fuzzing, 20 examples a route and mode here;
`PAGEDLLM_FUZZ_EXAMPLES=500 pytest tests/test_fuzz.py` is the longer one (docs/benchmarks-history.md).
A second server, a vision-language model's, has its image-carrying routes fuzzed the same way."""

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
ROUTES = [
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/embeddings",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /v1/responses",
    "POST /score",
    "POST /v1/score",
    "POST /rerank",
    "POST /v1/rerank",
    "POST /v2/rerank",
    "POST /classify",
    "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}",
    "POST /tokenize",
    "POST /detokenize",
    "GET /v1/models",
    "POST /v1/load_lora_adapter",
    "POST /v1/unload_lora_adapter",
    "GET /health",
    "GET /version",
    "GET /metrics",
    "GET /dashboard",
    "GET /dashboard/state",
]
TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "examples", "tool_chat_template_hermes.jinja")


@pytest.fixture(scope="module")
def fuzz_server(llama_dir, tmp_path_factory):
    from lora_utils import make_adapter

    adapter = make_adapter(llama_dir, tmp_path_factory.mktemp("fuzz-adapter"), rank=4)
    # A short context keeps what a generated request may ask for (n x max_tokens) small.
    server = Server(
        llama_dir,
        "--enable-lora",
        "--lora-modules",
        f"tiny-lora={adapter}",
        "--max-model-len",
        "64",
        "--kv-cache-memory",
        "16MiB",
        "--served-model-name",
        "tiny",
        "--chat-template",
        TEMPLATE,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}',
        "--long-prefill-token-threshold",  # prompts beside decodes go a token or two a step
        "0.5",
        "--kv-offload-dir",  # every block through the disk tier too
        str(tmp_path_factory.mktemp("fuzz-kv")),
        "--kv-offload-size",
        "64MiB",
        "--enforce-eager",  # (the CPU's passes are eager anyway: the flag is taken)
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


def test_every_route_is_fuzzed(api_schema):
    found = {f"{op.ok().method.upper()} {op.ok().path}" for op in api_schema.get_all_operations()}
    assert found == set(ROUTES)


# Invalid inputs (negative mode) exist only where a route takes a body.
CASES = [
    (route, mode)
    for route in ROUTES
    for mode in schemathesis.GenerationMode
    if route.startswith("POST") or mode == schemathesis.GenerationMode.POSITIVE
]


def _check_response(route: str, case, fuzz_server) -> None:
    response = case.call(base_url=fuzz_server.url, timeout=120)
    STATUSES[route, response.status_code] += 1
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        error = body.get("error")
        fields = {"message", "type", "param", "code"}
        if route.startswith("POST /v1/messages"):  # Anthropic's shape there
            assert body.get("type") == "error", response.text
            fields = {"message", "type"}
        assert isinstance(error, dict) and set(error) == fields, response.text
        assert isinstance(error["message"], str) and error["message"]


@pytest.mark.parametrize("route", ROUTES)
def test_coverage_phase_no_5xx_and_every_4xx_in_openai_shape(route, api_schema, fuzz_server):
    """Schemathesis' coverage phase: each schema's boundary values, missing required fields,
    wrong types, with and without `model` (as the CLI's `--phases coverage` generates them)."""
    _coverage_phase(route, api_schema, fuzz_server)


def _coverage_phase(route: str, schema, server) -> None:
    from schemathesis.generation.drivers import CoverageGenerator
    from schemathesis.generation.feedback import FeedbackSources
    from schemathesis.generation.overrides import Override

    method, path = route.split()
    operation = schema[path][method]
    config = schema.config.generation_for(operation=operation, phase="coverage")
    cases = CoverageGenerator(
        operation=operation,
        generation_modes=list(schemathesis.GenerationMode),
        generation_config=config,
        auth_storage=None,
        override=Override(),
        feedback=FeedbackSources(),
    )
    count = 0
    for case in cases:
        _check_response(route, case, server)
        count += 1
    assert count > 0
    assert server.process.poll() is None, "the server died under the coverage phase"


@pytest.mark.parametrize("route, mode", CASES, ids=[f"{r}-{m.value}" for r, m in CASES])
def test_no_5xx_and_every_4xx_in_openai_shape(route, mode, api_schema, fuzz_server):
    _random_phase(route, mode, api_schema, fuzz_server)


def _random_phase(route: str, mode, schema, server) -> None:
    method, path = route.split()
    operation = schema[path][method]

    # The plugin's own parametrize does not run under this pytest; a plain hypothesis test does.
    # A third of the bodies drop their random `model`, which would otherwise stop nearly every request at
    # the model check before any deeper code runs, and a third name the LoRA adapter (where served).
    @given(case=operation.as_strategy(generation_mode=mode), model=st.sampled_from(["keep", "drop", "adapter"]))
    @settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    def check(case, model: str) -> None:
        if model == "drop" and isinstance(case.body, dict):
            case.body.pop("model", None)
        if model == "adapter" and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "tiny-lora"
        _check_response(route, case, server)

    check()
    assert server.process.poll() is None, "the server died under fuzzing"


# A vision-language server (the tiny LLaVA, its image template, at most 2 images a prompt): the
# routes whose bodies carry image parts, both phases.
IMAGE_ROUTES = ["POST /v1/chat/completions", "POST /v1/messages", "POST /v1/responses", "POST /tokenize"]


@pytest.fixture(scope="module")
def image_server(llava_dir, tmp_path_factory):
    from vlm_utils import CHAT_TEMPLATE

    template = tmp_path_factory.mktemp("fuzz_images") / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    server = Server(
        llava_dir,
        "--max-model-len",
        "64",
        "--kv-cache-memory",
        "16MiB",
        "--chat-template",
        str(template),
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--kv-offload-dir",
        str(tmp_path_factory.mktemp("fuzz-images-kv")),
    )
    yield server
    server.stop()


@pytest.mark.parametrize("route", IMAGE_ROUTES)
def test_images_fuzzed_on_a_vision_language_server(route, image_server):
    schema = schemathesis.openapi.from_url(f"{image_server.url}/openapi.json")
    _coverage_phase(route, schema, image_server)
    for mode in schemathesis.GenerationMode:
        _random_phase(route, mode, schema, image_server)
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 2}
    assert httpx.post(f"{image_server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_the_server_still_serves_after_fuzzing(fuzz_server):
    print(
        f"\nfuzzed: {sum(STATUSES.values())} requests;",
        ", ".join(f"{r} {c}: {n}" for (r, c), n in sorted(STATUSES.items())),
    )
    body = {"prompt": "Hello", "max_tokens": 3, "model": "tiny"}
    assert httpx.post(f"{fuzz_server.url}/v1/completions", json=body, timeout=60).status_code == 200
    assert httpx.get(f"{fuzz_server.url}/health").status_code == 200
