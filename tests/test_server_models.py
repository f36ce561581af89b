"""Several models on one server (--models-dir): /v1/models lists them all, a request loads its
model on demand (outputs those of the offline engine on that model), the least recently used idle
one is unloaded to make room and any idle past --model-idle-ttl, a load past --model-load-timeout
is a 503, the key is checked before anything loads, and /metrics holds each loaded model's series."""

from __future__ import annotations

import shutil
import time

import httpx
import pytest
from openai import APIStatusError, AuthenticationError, NotFoundError, OpenAI

from pagedllm import LLM, SamplingParams
from server_utils import Server

KEY = "models-key"
ARGS = ["--kv-cache-memory", "16MiB", "--dtype", "float32", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, tiny_models):
    folder = tmp_path_factory.mktemp("models")
    shutil.copytree(tiny_models["llama"], folder / "alpha")
    shutil.copytree(tiny_models["qwen2"], folder / "qwen")
    (folder / "notes.txt").write_text("not a model")
    return folder


@pytest.fixture(scope="module")
def server(llama_dir, models_dir):
    server = Server(
        llama_dir, *ARGS, "--served-model-name", "main", "--models-dir", str(models_dir),
        "--max-loaded-models", "2", "--model-idle-ttl", "3", api_key=KEY,
    )  # fmt: skip
    yield server
    server.stop()


def _loaded(server) -> dict[str, bool]:
    cards = httpx.get(f"{server.url}/v1/models", headers=server.headers).json()["data"]
    return {c["id"]: c["loaded"] for c in cards}


def _greedy(model_dir: str, prompt: str) -> str:
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def test_models_load_on_demand_and_make_room(server, models_dir, tiny_models):
    client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert _loaded(server) == {"main": True, "alpha": False, "qwen": False}
    with pytest.raises(AuthenticationError):  # the key is checked before a model loads
        OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).completions.create(
            model="alpha", prompt="Hi", max_tokens=2
        )
    assert _loaded(server)["alpha"] is False
    greedy = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    alpha = client.completions.create(model="alpha", prompt="The sky", **greedy)
    assert alpha.model == "alpha" and alpha.choices[0].text == _greedy(str(models_dir / "alpha"), "The sky")
    assert _loaded(server) == {"main": True, "alpha": True, "qwen": False}
    qwen = client.completions.create(model="qwen", prompt="The sky", **greedy)
    assert qwen.choices[0].text == _greedy(tiny_models["qwen2"], "The sky")
    assert _loaded(server) == {"main": True, "alpha": False, "qwen": True}  # alpha made room (2 at most)
    main = client.completions.create(model="main", prompt="The sky", **greedy)
    assert main.choices[0].text == alpha.choices[0].text  # (the same weights)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'pagedllm:generation_tokens_total{model_name="qwen"} 6.0' in metrics
    assert 'pagedllm:generation_tokens_total{model_name="main"} 6.0' in metrics
    # Other routes go to the model they name; a stored response is found whichever model made it.
    response = client.responses.create(model="qwen", input="Hi", max_output_tokens=3)
    assert client.responses.retrieve(response.id).model == "qwen"
    messages = httpx.post(
        f"{server.url}/v1/messages", headers={"x-api-key": KEY},
        json={"model": "qwen", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
    )  # fmt: skip
    assert messages.status_code == 200 and messages.json()["model"] == "qwen"
    with pytest.raises(NotFoundError):
        client.completions.create(model="gamma", prompt="Hi", max_tokens=2)
    deadline = time.monotonic() + 20
    while _loaded(server)["qwen"] and time.monotonic() < deadline:  # idle past --model-idle-ttl
        time.sleep(0.5)
    assert _loaded(server) == {"main": True, "alpha": False, "qwen": False}
    assert client.completions.create(model="main", prompt="Hi", max_tokens=2).choices


def test_a_request_past_the_load_timeout_gets_503(llama_dir, models_dir):
    server = Server(
        llama_dir, *ARGS, "--models-dir", str(models_dir), "--model-load-timeout", "0.01",
        "--allowed-origins", "http://app.test", api_key=KEY,
    )  # fmt: skip
    try:
        # CORS in front of the key (a preflight has none) and once (not again in each model's app).
        preflight = httpx.options(
            f"{server.url}/v1/completions",
            headers={"Origin": "http://app.test", "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code == 200
        listed = httpx.get(f"{server.url}/v1/models", headers={**server.headers, "Origin": "http://app.test"})
        assert listed.headers.get_list("access-control-allow-origin") == ["http://app.test"]
        client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(APIStatusError) as info:
            client.completions.create(model="qwen", prompt="Hi", max_tokens=2)
        assert info.value.status_code == 503 and "loading" in info.value.message
        deadline = time.monotonic() + 60
        while not _loaded(server)["qwen"] and time.monotonic() < deadline:  # the load went on
            time.sleep(0.5)
        assert client.completions.create(model="qwen", prompt="Hi", max_tokens=2).choices
    finally:
        server.stop()


def test_bad_model_flags_stop_the_start(tmp_path, capsys):
    from pagedllm.entrypoints import cli

    assert cli.main(["generate", "x", "--model", "a", "--model", "b"]) == 2
    assert "only serve takes several models" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["serve", "--models-dir", str(tmp_path / "empty"), "--port", "0"]) == 2
    assert "holds no model" in capsys.readouterr().err
