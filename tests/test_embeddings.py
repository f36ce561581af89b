"""Embeddings (LLM.embed) against transformers on tiny random models: BERT encoders in
sentence-transformers folders (mean pooling, normalized) and plain ones ([CLS]), decoders by their
last token (and by the mean, over prompts computed in chunks); embedding requests batched in the
same steps as generation, keeping no KV after; and the bad inputs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from pagedllm import LLM, PoolingParams, SamplingParams

WORDS = (
    "the a of cat dog runs over lazy fox river bank money paged attention cache block token server "
    "request memory batch quick brown jumps engine model"
).split()
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a cat",
    "paged attention cache block",
    "the river bank holds money of the server",
    "token",
    "memory batch engine model request " * 5,
    "the dog runs",
    "quick quick quick",
]


def make_bert(
    path, pooling: str | None = "mean", normalize: bool = True, max_seq_length: int | None = 64, **overrides
) -> str:
    """A tiny random BERT with a WordPiece tokenizer; with `pooling`, a sentence-transformers folder
    (modules.json, 1_Pooling, Normalize if `normalize`)."""
    from transformers import BertConfig, BertModel, BertTokenizer

    letters = list("abcdefghijklmnopqrstuvwxyz")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *letters, *(f"##{c}" for c in letters)]
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    config = BertConfig(
        **{
            "vocab_size": len(vocab),
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "max_position_embeddings": 128,
            "initializer_range": 0.2,
            **overrides,
        }
    )
    torch.manual_seed(5)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if normalize:
            modules.append(
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
            )
        _write_json(os.path.join(path, "modules.json"), modules)
        os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
        _write_json(
            os.path.join(path, "1_Pooling", "config.json"),
            {
                "word_embedding_dimension": 64,
                "pooling_mode_mean_tokens": pooling == "mean",
                "pooling_mode_cls_token": pooling == "cls",
                "pooling_mode_lasttoken": pooling == "last",
            },
        )
        _write_json(os.path.join(path, "sentence_bert_config.json"), {"max_seq_length": max_seq_length})
    return str(path)


def _write_json(file: str, value) -> None:
    with open(file, "w") as f:
        json.dump(value, f)


def hf_hidden(path: str, token_ids: list[int], causal: bool = False) -> torch.Tensor:
    """transformers' last hidden states of one prompt, fp32: [tokens, hidden]."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]


def pooled(hidden: torch.Tensor, kind: str, normalize: bool = True) -> np.ndarray:
    vector = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[kind]
    return (torch.nn.functional.normalize(vector, dim=0) if normalize else vector).numpy()


def embed(llm: LLM, prompts, **kwargs) -> list[np.ndarray]:
    return [np.array(o.outputs.embedding) for o in llm.embed(prompts, use_tqdm=False, **kwargs)]


@pytest.mark.parametrize(
    "pooling,normalize",
    [("mean", True), ("cls", False), (None, True)],
    ids=["st-mean-normalized", "st-cls-raw", "plain-folder-cls"],
)
def test_bert_matches_transformers(tmp_path, pooling, normalize):
    """Sentences of many lengths in one batch, each pooled as its folder says (a folder without
    sentence-transformers modules: [CLS], normalized), equal to transformers' hidden states pooled."""
    path = make_bert(tmp_path, pooling, normalize)
    llm = LLM(path, dtype="float32")
    assert llm.engine.model_config.supported_tasks == ("embed",)
    ours = embed(llm, SENTENCES)
    tokenizer = llm.get_tokenizer()
    for sentence, vector in zip(SENTENCES, ours):
        expected = pooled(hf_hidden(path, tokenizer.encode(sentence)), pooling or "cls", normalize)
        np.testing.assert_allclose(vector, expected, atol=2e-5, rtol=1e-4)
    # Token ids give the same vector as their text; an embedding's length is the hidden size.
    by_ids = embed(llm, [{"prompt_token_ids": tokenizer.encode(SENTENCES[0])}])[0]
    np.testing.assert_allclose(by_ids, ours[0], atol=2e-5, rtol=1e-4)
    assert len(ours[0]) == 64


def test_bert_in_bf16_close_to_fp32(tmp_path):
    path = make_bert(tmp_path)
    fp32 = embed(LLM(path, dtype="float32"), SENTENCES)
    bf16 = embed(LLM(path, dtype="bfloat16"), SENTENCES)
    for a, b in zip(fp32, bf16):
        assert float(a @ b) / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.999


def test_bert_max_seq_length_and_truncation(tmp_path):
    """A sentence-transformers folder's max_seq_length is the model's length; a longer input is
    refused unless truncate_prompt_tokens keeps its last tokens (vLLM's rule)."""
    path = make_bert(tmp_path, max_seq_length=16)
    llm = LLM(path, dtype="float32")
    assert llm.engine.max_model_len == 16
    long_ids = list(range(5, 25))
    with pytest.raises(ValueError, match="at most 16"):
        llm.embed([long_ids], use_tqdm=False)
    (cut,) = embed(llm, [long_ids], truncate_prompt_tokens=10)
    np.testing.assert_allclose(cut, pooled(hf_hidden(path, long_ids[-10:]), "mean"), atol=2e-5, rtol=1e-4)
    (whole,) = embed(llm, [long_ids], truncate_prompt_tokens=-1)
    np.testing.assert_allclose(whole, pooled(hf_hidden(path, long_ids[-16:]), "mean"), atol=2e-5, rtol=1e-4)


def test_bert_prompts_go_whole_into_steps(tmp_path):
    """An encoder's prompt is never chunked: with a budget of 40 tokens a step, prompts of 30 tokens
    go one a step, whole, and all come out right."""
    path = make_bert(tmp_path, max_seq_length=40)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=40)
    steps = []
    runner = llm.engine.model_runner
    execute = runner.execute
    runner.execute = lambda output: steps.append([r.num_new_tokens for r in output.scheduled]) or execute(output)
    prompts = [list(range(5 + i, 35 + i)) for i in range(3)]
    ours = embed(llm, prompts)
    assert steps == [[30], [30], [30]]
    for ids, vector in zip(prompts, ours):
        np.testing.assert_allclose(vector, pooled(hf_hidden(path, ids), "mean"), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(path, dtype="float32", max_num_batched_tokens=32)


def test_matryoshka_dimensions(tmp_path):
    """A Matryoshka model cuts its embedding to `dimensions`, then normalizes; another model refuses."""
    path = make_bert(tmp_path, is_matryoshka=True)
    llm = LLM(path, dtype="float32")
    ids = llm.get_tokenizer().encode(SENTENCES[0])
    (cut,) = embed(llm, [ids], pooling_params=PoolingParams(dimensions=16))
    full = hf_hidden(path, ids).mean(0)
    np.testing.assert_allclose(cut, torch.nn.functional.normalize(full[:16], dim=0).numpy(), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="dimensions 65"):
        llm.embed([ids], pooling_params=PoolingParams(dimensions=65), use_tqdm=False)
    plain = LLM(make_bert(tmp_path / "plain"), dtype="float32")
    with pytest.raises(ValueError, match="matryoshka"):
        plain.embed([ids], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)


def test_decoder_last_token_pooling(llama_dir):
    """A decoder embeds by its last token's final hidden state, normalized, the prompts computed in
    chunks of 16 tokens beside each other; raw (normalize=False) is that state itself."""
    llm = LLM(llama_dir, dtype="float32", max_num_batched_tokens=16, kv_cache_memory="16MiB")
    assert llm.engine.model_config.supported_tasks == ("generate", "embed")
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    for ids, vector in zip(prompts, embed(llm, prompts)):
        np.testing.assert_allclose(vector, pooled(hf_hidden(llama_dir, ids), "last"), atol=2e-5, rtol=1e-4)
    (raw,) = embed(llm, [prompts[2]], pooling_params=PoolingParams(normalize=False))
    np.testing.assert_allclose(raw, hf_hidden(llama_dir, prompts[2])[-1].numpy(), atol=1e-4, rtol=1e-4)


def test_decoder_mean_pooling_over_chunks(llama_dir):
    """--pooler-config MEAN on a decoder: the mean of every prompt position's state, though the
    prompt's chunks came in different steps, and though a KV cache of 256 tokens made it give way
    mid-prompt to an older request generating 240 tokens (preempted, its pooling started over)."""
    llm = LLM(
        llama_dir,
        dtype="float32",
        max_num_batched_tokens=32,
        max_model_len=256,
        kv_cache_memory=16 * 16 * 512,
        pooler_config={"pooling_type": "mean"},
    )
    short = [list(range(5, 5 + n)) for n in (40, 9)]
    for ids, vector in zip(short, embed(llm, short)):
        np.testing.assert_allclose(vector, pooled(hf_hidden(llama_dir, ids), "mean"), atol=2e-5, rtol=1e-4)
    engine, long_ids = llm.engine, list(range(7, 247))
    engine.add_request("gen", list(range(5, 15)), SamplingParams(temperature=0, max_tokens=240, ignore_eos=True))
    engine.add_request("emb", long_ids, PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.stats().num_preemptions > 0 and len(done["gen"].outputs[0].token_ids) == 240
    np.testing.assert_allclose(
        np.array(done["emb"].outputs.embedding), pooled(hf_hidden(llama_dir, long_ids), "mean"), atol=2e-5, rtol=1e-4
    )


def test_pooling_state_takes_a_rerun_chunk_once():
    """A failed step is rerun with the same chunks: positions already folded in are skipped."""
    from pagedllm.config import PoolerConfig
    from pagedllm.layers.pooler import Pooler, PoolingState

    rows = torch.randn(10, 4)
    for kind in ("MEAN", "CLS", "LAST"):
        pooler, once, twice = Pooler(PoolerConfig(kind, normalize=False)), PoolingState(), PoolingState()
        for state, chunks in ((once, [(0, 6), (6, 10)]), (twice, [(0, 6), (0, 6), (6, 10), (6, 10)])):
            for start, end in chunks:
                pooler.accumulate(state, rows[start:end], start)
        expected = {"MEAN": rows.mean(0), "CLS": rows[0], "LAST": rows[-1]}[kind]
        for state in (once, twice):
            np.testing.assert_allclose(pooler.finish(state, PoolingParams()), expected.numpy(), atol=1e-6)


def test_embeddings_batch_beside_generation_and_keep_no_kv(llama_dir):
    """Embedding and generation requests share steps; each comes out as it does alone; embedding
    prompts neither read nor fill the prefix cache; once all are done no block is held."""
    args = dict(dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64)
    prompts = [list(range(5, 5 + n)) for n in (20, 7, 33)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone_text = [o.outputs[0].token_ids for o in LLM(llama_dir, **args).generate(prompts, greedy, use_tqdm=False)]
    alone_vectors = embed(LLM(llama_dir, **args), prompts)

    llm = LLM(llama_dir, **args)
    engine = llm.engine
    kinds_per_step = []
    runner = engine.model_runner
    execute = runner.execute
    runner.execute = lambda output: (
        kinds_per_step.append(
            {
                runner.input_batch.requests[r.request_id].pooling_params is not None
                if r.request_id in runner.input_batch.requests
                else r.new_request.pooling_params is not None
                for r in output.scheduled
            }
        )
        or execute(output)
    )
    for i, ids in enumerate(prompts):
        engine.add_request(f"gen{i}", ids, greedy)
        engine.add_request(f"emb{i}", ids, PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    assert {True, False} in kinds_per_step  # a step ran both kinds
    for i in range(len(prompts)):
        assert done[f"gen{i}"].outputs[0].token_ids == alone_text[i]
        np.testing.assert_allclose(np.array(done[f"emb{i}"].outputs.embedding), alone_vectors[i], atol=1e-6)
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.prefix_cache_queries == sum(map(len, prompts))  # the generation prompts' lookups only
    # An embedding of the same prompt after generation computed it: still computed whole, still equal.
    np.testing.assert_allclose(embed(llm, [prompts[0]])[0], alone_vectors[0], atol=1e-6)


def test_wrong_task_and_bad_params(tmp_path, llama_dir):
    bert = LLM(make_bert(tmp_path), dtype="float32")
    with pytest.raises(ValueError, match="does not serve text generation"):
        bert.generate(["the cat"], SamplingParams(max_tokens=2), use_tqdm=False)
    generate_only = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB", runner="generate")
    with pytest.raises(ValueError, match="does not serve embeddings"):
        generate_only.embed(["the cat"], use_tqdm=False)
    pooling_only = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB", runner="pooling")
    with pytest.raises(ValueError, match="does not serve text generation"):
        pooling_only.generate(["the cat"], use_tqdm=False)
    with pytest.raises(ValueError, match="encoder"):
        LLM(make_bert(tmp_path / "b2"), runner="generate")
    with pytest.raises(ValueError, match="unknown runner"):
        LLM(llama_dir, runner="embed")
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(llama_dir, pooler_config={"pooling_type": "max"})
    with pytest.raises(ValueError, match="unknown pooler_config keys"):
        LLM(llama_dir, pooler_config={"pooling": "mean"})
    for bad in ({"dimensions": 0}, {"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": -2}, {"task": "reward"}):
        with pytest.raises(ValueError):
            PoolingParams(**bad)
    with pytest.raises(ValueError, match="empty"):
        bert.embed([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        bert.embed([[10**6]], use_tqdm=False)
    assert len(bert.embed(["the cat"], use_tqdm=False)[0].outputs.embedding) == 64  # still serving
