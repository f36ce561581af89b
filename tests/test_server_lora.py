"""LoRA adapters through the real server on the default model (its Q4_1 GGUF file), with the official
openai client: adapters of rank 8 and 64 (made by peft in the test, for the model's first two
layers), one loaded at start (--lora-modules), one at runtime (/v1/load_lora_adapter), listed by
/v1/models, their outputs those of the offline engine with the same adapter; bad names and paths
answered 400/404 in OpenAI's shape, and the server goes on."""

from __future__ import annotations

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from conftest import _DEFAULT_GGUF, default_model_dir
from lora_utils import adapter_of
from pagedllm import LLM, LoRARequest, SamplingParams
from server_utils import Server

KEY = "lora-key"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    """PEFT adapters of the default model's shapes on its first two layers (a model of two random
    layers stands in for it: an adapter holds only its own weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(default_model_dir(), gguf_file=_DEFAULT_GGUF)
    config.num_hidden_layers = 2
    root = tmp_path_factory.mktemp("server_adapters")
    paths = {}
    for name, rank in (("r8", 8), ("r64", 64)):
        torch.manual_seed(rank)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        paths[name] = adapter_of(model, root / name, rank=rank, seed=rank, scale=0.05)
    return paths


@pytest.fixture(scope="module")
def server(adapters):
    model = f"{default_model_dir()}/{_DEFAULT_GGUF}"
    args = ["--enable-lora", "--max-lora-rank", "64", "--max-loras", "2", "--lora-modules", f"r8={adapters['r8']}"]
    server = Server(model, *args, "--max-model-len", "512", api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(adapters) -> dict[str | None, list[int]]:
    """The offline engine's greedy tokens for PROMPT, under each adapter and the base model."""
    llm = LLM(None, enable_lora=True, max_lora_rank=64, max_loras=2, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=12)
    loras = {None: None, "r8": LoRARequest("r8", 1, adapters["r8"]), "r64": LoRARequest("r64", 2, adapters["r64"])}
    outputs = {name: llm.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0] for name, lora in loras.items()}
    llm.engine.shutdown()
    return {name: o.outputs[0].text for name, o in outputs.items()}


def _complete(client: OpenAI, model: str) -> str:
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert response.model == model
    return response.choices[0].text


def test_adapters_listed_served_and_loaded_at_runtime(server, client, adapters, offline):
    base = client.models.list().data[0].id
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {base, "r8"} and cards["r8"].parent == base and cards[base].parent is None
    assert _complete(client, "r8") == offline["r8"]
    assert _complete(client, base) == offline[None] != offline["r8"]
    # At runtime, behind the API key.
    body = {"lora_name": "r64", "lora_path": adapters["r64"]}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=body).status_code == 401
    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=server.headers)
    assert loaded.status_code == 200, loaded.text
    assert {m.id for m in client.models.list().data} == {base, "r8", "r64"}
    chat_free = _complete(client, "r64")
    assert chat_free == offline["r64"] != offline[None]
    chat = client.chat.completions.create(
        model="r64", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    assert chat.model == "r64" and chat.choices[0].message.content is not None
    # Unloaded: gone from the list, refused by name; the others still served.
    unloaded = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "r64"}, headers=server.headers)
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(NotFoundError, match="r64"):
        _complete(client, "r64")
    assert _complete(client, "r8") == offline["r8"]


def test_bad_adapter_requests_are_refused_and_the_server_goes_on(server, client, adapters, tmp_path):
    with pytest.raises(NotFoundError, match="nope"):
        _complete(client, "nope")

    def load(name: str, path: str) -> httpx.Response:
        body = {"lora_name": name, "lora_path": path}
        return httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=server.headers)

    missing = load("ghost", str(tmp_path / "nowhere"))
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    assert load("r8", adapters["r64"]).status_code == 400  # the name is taken
    base = client.models.list().data[0].id
    taken = load(base, adapters["r64"])
    assert taken.status_code == 400 and "already taken" in taken.json()["error"]["message"]
    gone = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "ghost"}, headers=server.headers)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    with pytest.raises(BadRequestError, match="embeddings|serve"):
        client.embeddings.create(model="r8", input="hi")
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert _complete(client, "r8")


def _metric_lines(server, name: str) -> list[str]:
    text = httpx.get(f"{server.url}/metrics").text
    return [line for line in text.splitlines() if line.startswith(name)]


def test_metrics_and_dashboard_show_adapters(server, client):
    before = _metric_lines(server, "pagedllm:lora_requests_total")
    # While a long r8 request runs, the info gauge names it running.
    with httpx.Client(base_url=server.url, timeout=60, headers=server.headers) as http:
        body = {"model": "r8", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            info = _metric_lines(server, "pagedllm:lora_requests_info")
            state = http.get("/dashboard/state").json()
            for _ in lines:
                pass
    assert len(info) == 1 and 'running_lora_adapters="r8"' in info[0] and 'max_lora="2"' in info[0]
    views = [q for replica in state["replicas"] for q in replica["requests"]]
    assert [q["lora"] for q in views] == ["r8"]
    assert state["replicas"][0]["stats"]["running_loras"] == ["r8"]
    after = _metric_lines(server, "pagedllm:lora_requests_total")
    count = lambda lines: sum(float(x.split()[-1]) for x in lines if 'lora_name="r8"' in x)  # noqa: E731
    assert count(after) == count(before) + 1
    tokens = _metric_lines(server, "pagedllm:lora_generation_tokens_total")
    assert any('lora_name="r8"' in x and float(x.split()[-1]) >= 200 for x in tokens)
    idle = _metric_lines(server, "pagedllm:lora_requests_info")
    assert len(idle) == 1 and 'running_lora_adapters=""' in idle[0]
