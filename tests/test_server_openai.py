"""The official `openai` client against a real server process."""

from __future__ import annotations

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from pagedllm import LLM, SamplingParams
from server_utils import Server

KEY = "test-key"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    server = Server(
        llama_dir,
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "32MiB",
        "--dtype",
        "float32",
        "--served-model-name",
        "tiny",
        api_key=KEY,
        log_path=str(log),
    )
    yield server
    # SIGTERM shuts down cleanly (uvicorn re-raises the signal once it has finished).
    assert server.stop() in (0, -15)
    text = log.read_text()
    assert "KV cache:" in text and "Serving tiny" in text and "Application shutdown complete" in text


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_usage_and_greedy_equals_offline_llm(client, tokenizer, llama_dir):
    prompt = "The quick brown fox"
    result = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, logprobs=1, **GREEDY)
    choice = result.choices[0]
    assert result.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert result.usage.completion_tokens == len(choice.logprobs.tokens) == 10
    assert result.usage.total_tokens == result.usage.prompt_tokens + 10
    assert choice.finish_reason == "length"
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    offline = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert choice.text == offline[0].outputs[0].text
    streamed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_streaming_and_not(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, **GREEDY)
    assert full.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 8


def test_n_and_seed(client):
    def sample(seed):
        r = client.completions.create(
            model="tiny",
            prompt="Once upon",
            max_tokens=8,
            n=2,
            seed=seed,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample(11)
    assert len(first) == 2 and first == sample(11)
    assert first != sample(12)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4, seed=1, temperature=1.0
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_logprobs_and_echo_scoring(client, tokenizer):
    prompt = "Paris is the capital of France"
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    n = len(tokenizer.encode(prompt))
    assert choice.text == prompt
    assert len(choice.logprobs.tokens) == n and choice.logprobs.token_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in choice.logprobs.token_logprobs[1:])
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == n
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.logprob for item in content)


def test_stop_string(client):
    free = client.completions.create(model="tiny", prompt="Count:", max_tokens=16, **GREEDY).choices[0].text
    stop = free[5:8]
    stopped = client.completions.create(model="tiny", prompt="Count:", max_tokens=16, stop=[stop], **GREEDY).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == free[: free.index(stop)]


def test_bench_serve_against_the_server_counts_what_the_server_counted(server, tmp_path, capsys):
    """`pagedllm bench serve`: every request through, its token totals equal to the server's own
    counters' growth over the run, and the chat backend too."""
    import json
    import re

    import httpx

    from pagedllm.entrypoints.cli import main

    def generated() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return float(re.search(r"^pagedllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M).group(1))

    before = generated()
    common = [
        "bench",
        "serve",
        "--base-url",
        server.url,
        "--api-key",
        KEY,
        "--num-prompts",
        "5",
        "--disable-tqdm",
        "--random-output-len",
        "6",
        "--random-token-range",
        "100",
        "1000",
        "--seed",
        "3",
    ]
    assert (
        main(
            [
                *common,
                "--random-input-len",
                "12",
                "--ignore-eos",
                "--max-concurrency",
                "2",
                "--result-filename",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["requests"], result["failed"], result["output_tokens"], result["input_tokens"]) == (5, 0, 30, 60)
    assert generated() - before == 30
    assert "Successful requests" in capsys.readouterr().out
    assert main([*common, "--backend", "openai-chat", "--random-input-len", "8", "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"Successful requests\s+5\n", out) and re.search(r"Failed requests\s+0\n", out)
    # The Responses and Messages routes, read from their own streams' events and usage.
    for backend in ("openai-responses", "anthropic-messages"):
        before = generated()
        path = tmp_path / f"{backend}.json"
        argv = [*common, "--backend", backend, "--random-input-len", "8", "--model", "tiny", "--ignore-eos"]
        assert main([*argv, "--result-filename", str(path)]) == 0
        result = json.loads(path.read_text())
        assert (result["requests"], result["failed"], result["output_tokens"]) == (5, 0, 30), backend
        assert result["input_tokens"] > 0 and generated() - before == 30


def test_grafana_dashboard_queries_only_series_the_server_exports(server, client):
    """docs/grafana-dashboard.json: each pagedllm:* name its queries use is a series of /metrics."""
    import json
    import pathlib
    import re

    import httpx

    client.completions.create(model="tiny", prompt="Hi", max_tokens=2)  # (a finished request's series too)
    board = json.loads((pathlib.Path(__file__).parents[1] / "docs" / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"pagedllm:[a-z0-9_]+", expr)}
    # A series declared but without samples yet (speculative decoding's, off here) counts by its HELP line.
    exposition = httpx.get(f"{server.url}/metrics").text
    declared = re.findall(r"^# HELP (pagedllm:[a-z0-9_]+)", exposition, re.M)
    exported = set(re.findall(r"^(pagedllm:[a-z0-9_]+)", exposition, re.M)) | {
        name + suffix for name in declared for suffix in ("", "_total", "_bucket", "_sum", "_count")
    }
    assert len(used) >= 15 and used <= exported, used - exported
    assert len({panel["id"] for panel in board["panels"]}) == len(board["panels"])


def test_beam_search_on_the_server_equals_the_offline_llm(client, llama_dir):
    """vLLM's use_beam_search and length_penalty extras: the n best beams as the choices, as the
    offline LLM.beam_search gives them (itself held to transformers), streamed or not, in completions
    and chat; what beam search does not use is refused by name."""
    from openai import BadRequestError

    from pagedllm import BeamSearchParams

    prompt = "The quick brown fox"
    beams = {"use_beam_search": True, "length_penalty": 0.5, "ignore_eos": True}
    result = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=6, extra_body=beams)
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True, length_penalty=0.5)
    offline = llm.beam_search([prompt], params)[0].sequences
    assert [c.text for c in result.choices] == [s.text for s in offline]
    assert [c.index for c in result.choices] == [0, 1, 2] and {c.finish_reason for c in result.choices} == {"length"}
    assert result.usage.completion_tokens == 18
    streamed = list(
        client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=6, stream=True, extra_body=beams)
    )
    texts = {i: "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) for i in range(3)}
    assert [texts[i] for i in range(3)] == [s.text for s in offline]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4, extra_body=beams
    )
    assert len(chat.choices) == 2 and all(c.message.content is not None for c in chat.choices)
    refused = [
        ({"temperature": 0.7}, "temperature"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"top_p": 0.5}, "top_p"),
    ]
    for extra, name in refused:
        with pytest.raises(BadRequestError, match=name):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=4, extra_body={**beams, **extra})
    with pytest.raises(BadRequestError, match="length_penalty"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4, extra_body={"length_penalty": 0.5})


def test_bad_words_allowed_tokens_and_logit_bias_equal_the_offline_llm(client, llama_dir):
    """vLLM's sampling extras through the client's extra_body, on both endpoints: the offline
    engine's greedy tokens under the same parameters (and different ones without them)."""
    from openai import BadRequestError

    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    tokenizer = llm.get_tokenizer()
    prompt, messages = "The quick brown fox", [{"role": "user", "content": "Hi"}]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    first = plain[0].outputs[0].token_ids
    extras = [
        {"bad_words": [tokenizer.decode(first[:1])]},
        {"allowed_token_ids": sorted(set(first[2:]) | {17, 42})},
        {"logit_bias": {str(first[1]): -100.0, "314": 100.0}},
    ]
    for extra in extras:
        bias = {int(k): v for k, v in extra.get("logit_bias", {}).items()}
        fields = {"bad_words": extra.get("bad_words"), "allowed_token_ids": extra.get("allowed_token_ids")}
        offline = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias or None, **fields)
        want = llm.generate([prompt], offline, use_tqdm=False)[0].outputs[0]
        assert want.token_ids != first, extra
        body = {"ignore_eos": True}
        got = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={**body, **extra}
        )
        assert got.choices[0].text == want.text, extra
        chat = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body={**body, **extra}
        )
        chat_want = llm.chat(messages, offline, use_tqdm=False)[0].outputs[0].text
        assert chat.choices[0].message.content == chat_want, extra
    with pytest.raises(BadRequestError) as info:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"foo": 1})
    assert info.value.body["param"] == "foo" and info.value.body["code"] == "unsupported_parameter"
    with pytest.raises(BadRequestError, match="scheduling-policy priority"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"priority": 1})
