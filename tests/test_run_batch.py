"""`pagedllm run-batch`: an OpenAI batch file through the server's app in this process, answers in
input order, a bad line answered alone while the others run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints import cli

ENGINE = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256"]
MESSAGES = [{"role": "user", "content": "Hi"}]


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(model: str, tmp_path, lines: list[str], *extra: str, engine=ENGINE) -> tuple[int, list[dict]]:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\r\n".join(lines) + "\n", encoding="utf-8")
    code = cli.main(["run-batch", model, "-i", str(source), "-o", str(target), *engine, *extra])
    return code, [json.loads(line) for line in target.read_text().splitlines()]


def test_a_mixed_file_is_answered_in_order_with_bad_lines_alone(llama_dir, tmp_path, capsys):
    prompts = [f"Story {i}:" for i in range(6)]
    lines = [
        _line(f"cmpl-{i}", "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        for i, p in enumerate(prompts)
    ]
    lines += [
        _line("chat", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, "temperature": 0}),
        "{not json",
        "",
        _line("bad-temperature", "/v1/completions", {"prompt": "x", "temperature": -1}),
        _line("cmpl-0", "/v1/completions", {"prompt": "x"}),
        _line("moderation", "/v1/moderations", {"input": "x"}),
        _line("streamed", "/v1/completions", {"prompt": "x", "stream": True}),
        _line("unknown-field", "/v1/chat/completions", {"messages": MESSAGES, "foo": 1}),
        _line("embedding", "/v1/embeddings", {"input": "x"}),
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}),
        _line("last", "/v1/completions", {"prompt": prompts[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}),
    ]
    code, out = _run(llama_dir, tmp_path, lines)
    assert code == 0 and "Running batch" in capsys.readouterr().err
    assert len(out) == len(lines) - 1  # the blank line is no request
    ids = [o["custom_id"] for o in out]
    assert ids == [*(f"cmpl-{i}" for i in range(6)), "chat", None, "bad-temperature", "cmpl-0", "moderation",
                   "streamed", "unknown-field", "embedding", "get", "last"]  # fmt: skip
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    texts = [o["response"]["body"]["choices"][0]["text"] for o in out[:6]]
    assert texts == [w.outputs[0].text for w in want]
    assert out[-1]["response"]["body"]["choices"][0]["text"] == texts[0]
    chat = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0].text
    assert out[6]["response"]["body"]["choices"][0]["message"]["content"] == chat
    for o in out[:7] + out[-1:]:
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["request_id"] == o["response"]["body"]["id"]
    errors: dict[str | None, dict] = {}
    for o in out:
        errors.setdefault(o["custom_id"], o)
    assert out[7]["response"] is None and out[7]["error"]["code"] == "invalid_json" and out[7]["error"]["line"] == 8
    assert errors["cmpl-0"]["error"] is None  # the first cmpl-0 kept its answer...
    assert out[9]["error"]["code"] == "duplicate_custom_id"  # ...the second is refused
    assert errors["moderation"]["error"]["code"] == "unsupported_url"
    assert errors["get"]["error"]["code"] == "invalid_request"
    for custom_id, param in [("bad-temperature", "temperature"), ("streamed", "stream"), ("unknown-field", "foo")]:
        response = errors[custom_id]["response"]
        assert response["status_code"] == 400 and response["body"]["error"]["param"] == param
    assert errors["embedding"]["response"]["body"]["data"][0]["embedding"]  # (a decoder serves both)


def test_embeddings_lines_equal_the_offline_vectors(tmp_path):
    from test_embeddings import make_bert

    path = make_bert(tmp_path / "bert")
    texts = ["a cat", "the dog barks", "rain"]
    lines = [_line(f"e{i}", "/v1/embeddings", {"input": t}) for i, t in enumerate(texts)]
    lines.append(_line("both", "/v1/embeddings", {"input": texts[:2], "encoding_format": "float"}))
    lines.append(_line("completion", "/v1/completions", {"prompt": "a cat"}))
    lines.append(_line("score", "/v1/score", {"text_1": texts[0], "text_2": texts[1:]}))
    code, out = _run(path, tmp_path, lines, "--max-concurrency", "2", engine=["--dtype", "float32"])
    assert code == 0
    error = out[4]["response"]["body"]["error"]
    assert out[4]["response"]["status_code"] == 400 and "embeddings" in error["message"]  # an encoder: no text
    llm = LLM(path, dtype="float32")
    want = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    for o, vector in zip(out[:3], want):
        np.testing.assert_allclose(o["response"]["body"]["data"][0]["embedding"], vector, rtol=1e-5, atol=1e-6)
    both = [d["embedding"] for d in out[3]["response"]["body"]["data"]]
    np.testing.assert_allclose(both, want[:2], rtol=1e-5, atol=1e-6)
    cosines = [float(np.dot(want[0], v) / np.linalg.norm(want[0]) / np.linalg.norm(v)) for v in want[1:]]
    np.testing.assert_allclose([d["score"] for d in out[5]["response"]["body"]["data"]], cosines, atol=1e-5)


@pytest.mark.parametrize("case", ["missing", "same file"])
def test_an_unusable_input_exits_2(llama_dir, tmp_path, case, capsys):
    source = tmp_path / ("nowhere.jsonl" if case == "missing" else "in.jsonl")
    if case == "same file":
        source.write_text(_line("a", "/v1/completions", {"prompt": "x"}) + "\n")
    target = source if case == "same file" else tmp_path / "out.jsonl"
    assert cli.main(["run-batch", llama_dir, "-i", str(source), "-o", str(target), *ENGINE]) == 2
    assert "error:" in capsys.readouterr().err
