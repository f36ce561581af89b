"""/v1/embeddings through the official `openai` client against a real server: a tiny BERT
(sentence-transformers folder, Matryoshka) answers as transformers pools it, in float and base64,
for text and token ids, with `dimensions`; the wrong endpoint for a model, and bad inputs, get 400
in OpenAI's shape while the server goes on."""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI

from server_utils import Server
from test_embeddings import SENTENCES, hf_hidden, make_bert, pooled


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    path = make_bert(tmp_path_factory.mktemp("bert"), is_matryoshka=True)
    server = Server(
        path,
        "--dtype",
        "float32",
        "--served-model-name",
        "bert",
        log_path=str(tmp_path_factory.mktemp("logs") / "bert.log"),
    )
    yield server, path, OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    assert server.stop() in (0, -15)


def test_embeddings_match_transformers(bert):
    """The client's default (base64, decoded by it) and float give the same vectors, which are
    transformers' hidden states mean-pooled and normalized; usage counts the prompts' tokens."""
    _, path, client = bert
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(path)
    by_default = client.embeddings.create(model="bert", input=SENTENCES)
    as_float = client.embeddings.create(model="bert", input=SENTENCES, encoding_format="float")
    assert [d.index for d in by_default.data] == list(range(len(SENTENCES)))
    assert by_default.usage.prompt_tokens == sum(len(tokenizer.encode(s)) for s in SENTENCES)
    for sentence, a, b in zip(SENTENCES, by_default.data, as_float.data):
        expected = pooled(hf_hidden(path, tokenizer.encode(sentence)), "mean")
        np.testing.assert_allclose(a.embedding, expected, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-7)
    ids = tokenizer.encode(SENTENCES[0])
    one = client.embeddings.create(model="bert", input=ids).data
    several = client.embeddings.create(model="bert", input=[ids, ids[:3]]).data
    assert len(one) == 1 and len(several) == 2
    np.testing.assert_allclose(one[0].embedding, by_default.data[0].embedding, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(several[1].embedding, pooled(hf_hidden(path, ids[:3]), "mean"), atol=2e-5, rtol=1e-4)


def test_dimensions_and_concurrency(bert):
    """`dimensions` cuts then normalizes; many clients at once each get their own answer."""
    _, path, client = bert
    ids = __import__("transformers").AutoTokenizer.from_pretrained(path).encode(SENTENCES[3])
    cut = client.embeddings.create(model="bert", input=[ids], dimensions=8).data[0].embedding
    full = hf_hidden(path, ids).mean(0)
    np.testing.assert_allclose(cut, (full[:8] / full[:8].norm()).numpy(), atol=2e-5, rtol=1e-4)

    def one(i: int) -> list[float]:
        return client.embeddings.create(model="bert", input=SENTENCES[i % len(SENTENCES)]).data[0].embedding

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(24)))
    alone = client.embeddings.create(model="bert", input=SENTENCES).data
    for i, vector in enumerate(results):
        np.testing.assert_allclose(vector, alone[i % len(SENTENCES)].embedding, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": "the cat", "dimensions": 65}, "dimensions"),
        ({"input": "the cat", "dimensions": 0}, "dimensions"),
        ({"input": [[]]}, "input"),
        ({"input": [[10**6]]}, "input"),
        ({"input": "the cat", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "cat " * 100}, "input"),  # past max_seq_length (64)
        ({"input": "the cat", "model": "other"}, "model"),
        ({"input": 5}, "input"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_bad_embedding_requests_get_400(bert, body, param):
    server, _, _ = bert
    reply = httpx.post(f"{server.url}/v1/embeddings", json={"model": "bert", **body}, timeout=30)
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert error["type"] in ("invalid_request_error", "NotFoundError") and error["message"]
    assert error["param"] == param or param in error["message"]
    assert httpx.post(f"{server.url}/v1/embeddings", json={"input": "the cat"}, timeout=30).status_code == 200


def test_generation_on_an_encoder_gets_400(bert):
    _, _, client = bert
    with pytest.raises(openai.BadRequestError, match="does not serve text generation"):
        client.completions.create(model="bert", prompt="the cat", max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="does not serve text generation"):
        client.chat.completions.create(model="bert", messages=[{"role": "user", "content": "hi"}])
    assert len(client.embeddings.create(model="bert", input="the cat").data[0].embedding) == 64


def test_embeddings_on_a_generation_only_server_get_400(llama_dir, tmp_path):
    server = Server(
        llama_dir,
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--runner",
        "generate",
        "--served-model-name",
        "tiny",
        log_path=str(tmp_path / "server.log"),
    )
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not serve embeddings"):
            client.embeddings.create(model="tiny", input="hello")
        assert client.completions.create(model="tiny", prompt="hello", max_tokens=2).choices[0].text is not None
    finally:
        status = server.stop()
    assert status in (0, -15)
