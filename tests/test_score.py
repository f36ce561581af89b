"""Scores, reranking and classification: cross-encoders (BertForSequenceClassification) against
sentence-transformers' CrossEncoder on the same tiny random folders, classification against
transformers, embedding models' scores against SentenceTransformer's cosine; offline (LLM.score,
LLM.classify) and on the server (/score, /rerank, /classify)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from pagedllm import LLM
from server_utils import Server

QUERIES = ["a cat", "rain"]
DOCUMENTS = ["the dog barks", "a cat sits", "rain falls on the river", "cold wind"]


def make_cross_encoder(path, num_labels: int = 1, seed: int = 3) -> str:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    from test_embeddings import WORDS

    letters = list("abcdefghijklmnopqrstuvwxyz")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *letters, *(f"##{c}" for c in letters)]
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    labels = {i: name for i, name in enumerate(["negative", "neutral", "positive"][:num_labels])}
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=128, initializer_range=0.2, num_labels=num_labels,
        **({"id2label": labels, "label2id": {v: k for k, v in labels.items()}} if num_labels > 1 else {}),
    )  # fmt: skip
    torch.manual_seed(seed)
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> str:
    return make_cross_encoder(tmp_path_factory.mktemp("reranker"))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> str:
    return make_cross_encoder(tmp_path_factory.mktemp("classifier"), num_labels=3, seed=4)


def test_cross_encoder_scores_equal_sentence_transformers(reranker):
    from sentence_transformers import CrossEncoder

    oracle = CrossEncoder(reranker, device="cpu")
    llm = LLM(reranker, dtype="float32")
    one_to_many = [o.outputs.score for o in llm.score(QUERIES[0], DOCUMENTS, use_tqdm=False)]
    np.testing.assert_allclose(one_to_many, oracle.predict([(QUERIES[0], d) for d in DOCUMENTS]), atol=1e-5)
    pairwise = [o.outputs.score for o in llm.score(QUERIES, DOCUMENTS[:2], use_tqdm=False)]
    np.testing.assert_allclose(pairwise, oracle.predict(list(zip(QUERIES, DOCUMENTS[:2]))), atol=1e-5)
    # The pair's order matters (its second text is BERT's type 1): the scores are not symmetric.
    swapped = llm.score(DOCUMENTS[0], QUERIES[0], use_tqdm=False)[0].outputs.score
    assert abs(swapped - one_to_many[0]) > 1e-4
    with pytest.raises(ValueError, match="give one, or as many"):
        llm.score(QUERIES, DOCUMENTS, use_tqdm=False)
    long = " ".join(["rain"] * 200)
    with pytest.raises(ValueError, match="tokens"):
        llm.score(QUERIES[0], long, use_tqdm=False)
    cut = llm.score(QUERIES[0], long, truncate_prompt_tokens=40, use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 40
    short = CrossEncoder(reranker, device="cpu", max_length=40)  # (it cuts the longer text, the second)
    np.testing.assert_allclose(cut.outputs.score, short.predict([(QUERIES[0], long)]), atol=1e-5)


def test_classification_equals_transformers(classifier):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(classifier, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    llm = LLM(classifier, dtype="float32")
    outputs = llm.classify(DOCUMENTS, use_tqdm=False)
    with torch.no_grad():
        want = [torch.softmax(model(**tokenizer(d, return_tensors="pt")).logits[0], -1).numpy() for d in DOCUMENTS]
    for output, expected in zip(outputs, want):
        assert output.outputs.num_classes == 3
        np.testing.assert_allclose(output.outputs.probs, expected, atol=1e-5)
    with pytest.raises(ValueError, match="embeddings"):
        llm.embed(["a cat"], use_tqdm=False)


def test_an_embedding_models_scores_are_cosines(tmp_path):
    from sentence_transformers import SentenceTransformer

    from test_embeddings import make_bert

    path = make_bert(tmp_path / "bert")
    oracle = SentenceTransformer(path, device="cpu")
    llm = LLM(path, dtype="float32")
    ours = [o.outputs.score for o in llm.score(QUERIES[0], DOCUMENTS, use_tqdm=False)]
    vectors = oracle.encode([QUERIES[0], *DOCUMENTS], convert_to_tensor=True)
    want = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:]).numpy()
    np.testing.assert_allclose(ours, want, atol=1e-5)
    with pytest.raises(ValueError, match="classification"):
        llm.classify(["a cat"], use_tqdm=False)


@pytest.fixture(scope="module")
def server(reranker):
    server = Server(reranker, "--dtype", "float32", "--served-model-name", "reranker")
    yield server
    server.stop()


def test_score_and_rerank_routes_equal_the_cross_encoder(server, reranker):
    from sentence_transformers import CrossEncoder

    oracle = CrossEncoder(reranker, device="cpu")
    want = oracle.predict([(QUERIES[0], d) for d in DOCUMENTS])
    for path in ("/score", "/v1/score"):
        body = httpx.post(f"{server.url}{path}", json={"model": "reranker", "text_1": QUERIES[0], "text_2": DOCUMENTS})
        assert body.status_code == 200, body.text
        data = body.json()
        assert [d["index"] for d in data["data"]] == list(range(4)) and data["usage"]["prompt_tokens"] > 0
        np.testing.assert_allclose([d["score"] for d in data["data"]], want, atol=1e-5)
    ranked = oracle.rank(QUERIES[0], DOCUMENTS)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = httpx.post(f"{server.url}{path}", json={"query": QUERIES[0], "documents": DOCUMENTS, "top_n": 3})
        results = body.json()["results"]
        assert [r["index"] for r in results] == [r["corpus_id"] for r in ranked][:3]
        np.testing.assert_allclose([r["relevance_score"] for r in results], [r["score"] for r in ranked][:3], atol=1e-5)
        assert results[0]["document"]["text"] == DOCUMENTS[results[0]["index"]]
    bare = httpx.post(f"{server.url}/rerank", json={"query": "x", "documents": DOCUMENTS, "return_documents": False})
    assert len(bare.json()["results"]) == 4 and "document" not in bare.json()["results"][0]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/score", {"text_1": QUERIES, "text_2": DOCUMENTS}, "text_2"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/rerank", {"query": "a", "documents": ["b"], "foo": 1}, "foo"),
        ("/rerank", {"query": "a", "documents": ["b"], "model": "other"}, "model"),
        ("/classify", {"input": []}, "input"),
        ("/v1/embeddings", {"input": "a"}, "model"),
        ("/v1/completions", {"prompt": "a"}, "model"),
        ("/score", {"text_1": "a", "text_2": " ".join(["rain"] * 200)}, "text_2"),
        ("/score", {"text_1": "a", "text_2": "b", "priority": 1}, "priority"),
    ],
)
def test_bad_requests_are_400s_naming_their_field(server, path, body, param):
    response = httpx.post(f"{server.url}{path}", json=body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"].startswith(param), response.text
    assert httpx.post(f"{server.url}/score", json={"text_1": "a", "text_2": "b"}).status_code == 200


def test_classify_route(classifier):
    server = Server(classifier, "--dtype", "float32")
    try:
        body = httpx.post(f"{server.url}/classify", json={"input": DOCUMENTS[:2]}).json()
    finally:
        server.stop()
    llm = LLM(classifier, dtype="float32")
    want = [o.outputs.probs for o in llm.classify(DOCUMENTS[:2], use_tqdm=False)]
    assert [d["num_classes"] for d in body["data"]] == [3, 3]
    np.testing.assert_allclose([d["probs"] for d in body["data"]], want, atol=1e-6)
    assert all(d["label"] == ["negative", "neutral", "positive"][int(np.argmax(d["probs"]))] for d in body["data"])
