"""bad_words and logits_processors through the engine: vLLM's tokenization of the words, bans that
follow the output (at speculation's draft positions too), processors in both of V0's forms, and
the rule that a processor reaching another process must be importable there."""

from __future__ import annotations

import sys

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import InvalidParamError

ARGS = dict(dtype="float32", kv_cache_memory="16MiB", block_size=4)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, **ARGS)


def _greedy(llm, prompts, max_tokens=12, **params) -> list[list[int]]:
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(inputs, sampling, use_tqdm=False)]


def _words_at(llm, tokens: list[int], length: int) -> list[tuple[int, str]]:
    """Each position k where tokens[k:k+length] decode to a word that bad_words reads as those very
    tokens, with the word."""
    tokenizer = llm.get_tokenizer()
    found = []
    for k in range(1, len(tokens) - length + 1):
        word = tokenizer.decode(tokens[k : k + length])
        if word.strip() and llm.engine.bad_words_token_ids([word])[0] == tokens[k : k + length]:
            found.append((k, word))
    assert found, f"no {length}-token word in {tokens}"
    return found


def _word_at(llm, tokens: list[int], length: int) -> tuple[int, str]:
    return _words_at(llm, tokens, length)[0]


def test_words_are_read_as_vllm_reads_them(llm):
    tokenizer = llm.get_tokenizer()
    ids = llm.engine.bad_words_token_ids([" URL", "URL"])
    plain = tokenizer.encode("URL", add_special_tokens=False)
    spaced = tokenizer.encode(" URL", add_special_tokens=False)
    assert plain != spaced and len(plain) == len(spaced)
    assert ids == [plain, spaced] * 2  # the leading space is stripped; both forms are barred
    # The spaced form is barred only where it is as long as the plain one (vLLM's rule).
    longer = next(w for w in (" Alzheimer", " holy", " defective") if len(tokenizer.encode(w.strip())) > 1)
    assert llm.engine.bad_words_token_ids([longer]) == [tokenizer.encode(longer.strip(), add_special_tokens=False)]


def test_a_one_token_word_is_never_generated(llm):
    plain = _greedy(llm, [PROMPT])[0]
    k, word = _word_at(llm, plain, 1)
    banned = _greedy(llm, [PROMPT], bad_words=[word])[0]
    barred = {ids[0] for ids in llm.engine.bad_words_token_ids([word])}
    assert banned[:k] == plain[:k] and banned[k] != plain[k]
    assert not barred & set(banned)


def test_a_two_token_word_bars_its_end_only_after_its_start(llm):
    plain = _greedy(llm, [PROMPT], max_tokens=16)[0]
    k, word = _word_at(llm, plain, 2)
    banned = _greedy(llm, [PROMPT], max_tokens=16, bad_words=[word])[0]
    assert banned[: k + 1] == plain[: k + 1]  # its first token is still generated
    assert banned[k + 1] != plain[k + 1]
    words = llm.engine.bad_words_token_ids([word])
    pairs = set(zip(banned, banned[1:]))
    assert not any(tuple(w) in pairs for w in words if len(w) == 2)


def test_seeded_samples_keep_the_ban(llm):
    """n > 1 with a seed copies the parameters per sample (dataclasses.replace): the ban goes along."""
    params = dict(temperature=0.02, seed=3, n=2, max_tokens=1, ignore_eos=True)
    plain = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0]
    first = plain.outputs[0].token_ids[0]
    assert [s.token_ids[0] for s in plain.outputs] == [first, first]  # nearly greedy: the ban must show
    word = llm.get_tokenizer().decode([first])
    banned = llm.generate([PROMPT], SamplingParams(**params, bad_words=[word]), use_tqdm=False)[0]
    assert all(s.token_ids[0] != first for s in banned.outputs)


def test_bad_words_out_of_the_vocabulary_name_the_field():
    with pytest.raises(InvalidParamError) as info:
        SamplingParams(bad_words_token_ids=[[5, 70000]]).check_vocab(1000)
    assert info.value.param == "bad_words"
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["ok", "  "])


class _ExactDrafts:
    """Drafts the known outputs' next 3 tokens, all right: with every draft accepted, a step's
    window holds output indices 4m+1..4m+3 as drafts and 4m+4 as its own token."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        n = len(token_ids)
        for sequence in self.sequences:
            if sequence[:n] == token_ids:
                return sequence[n : n + min(3, limit if limit is not None else 3)]
        return []


def test_speculation_keeps_the_greedy_outputs_under_bad_words(llm, llama_dir):
    """A word's end is barred at a draft position whose earlier drafts hold its start: exact drafts
    of the banned run's outputs (each word chosen to start at a drafted index), then n-gram drafts,
    give the outputs of the engine without speculation."""
    from test_spec_decode import SPEC, fixed_drafts

    spec = fixed_drafts(LLM(llama_dir, speculative_config=SPEC, **ARGS))
    prompts = [list(range(5 + i, 25 + 2 * i)) for i in range(4)]
    plain = _greedy(llm, prompts, max_tokens=24)
    words = [next(w for k, w in _words_at(llm, tokens, 2) if k % 4) for tokens in plain]
    banned = _greedy(llm, prompts, max_tokens=24, bad_words=words)
    assert all(b != p for b, p in zip(banned, plain))
    core = spec.engine.core
    ngram, core.proposer = core.proposer, _ExactDrafts([p + o for p, o in zip(prompts, banned)])
    try:
        assert _greedy(spec, prompts, max_tokens=24, bad_words=words) == banned
        assert spec.engine.stats().spec_num_accepted_tokens > 40
    finally:
        core.proposer = ngram
    assert _greedy(spec, prompts, max_tokens=24, bad_words=words) == banned


def force_token(token: int):
    """A 2-argument processor that makes `token` the only choice at the first output position."""

    def processor(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if not output_ids:
            logits = torch.full_like(logits, float("-inf"))
            logits[token] = 0.0
        return logits

    return processor


def test_logits_processors_in_both_forms(llm):
    seen: list[tuple[int, int]] = []

    def second(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append((len(prompt_ids), len(output_ids)))
        if len(output_ids) == 1:
            logits[:] = float("-inf")
            logits[output_ids[0] + 1] = 0.0
        return logits

    prompt_len = len(llm.get_tokenizer().encode(PROMPT))
    out = _greedy(llm, [PROMPT], max_tokens=4, logits_processors=[force_token(777), second])[0]
    assert out[:2] == [777, 778]
    assert seen[:3] == [(prompt_len, 0), (prompt_len, 1), (prompt_len, 2)]


def test_a_failing_processor_fails_its_request_only(llm):
    def wrong_shape(output_ids, logits):
        return logits[:5]

    bad = SamplingParams(temperature=0, max_tokens=4, logits_processors=[wrong_shape])
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([PROMPT, PROMPT], [bad, good], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error" and "shape" in outputs[0].error
    assert len(outputs[1].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=[lambda logits: logits])  # one argument: neither form


def test_processors_reach_a_core_process_only_when_importable(llama_dir, tmp_path, monkeypatch):
    module = tmp_path / "bad_words_processors.py"
    module.write_text(
        "def force_42(output_ids, logits):\n"
        "    if not output_ids:\n"
        "        logits[:] = float('-inf')\n"
        "        logits[42] = 0.0\n"
        "    return logits\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(sys.path))
    from bad_words_processors import force_42

    llm = LLM(llama_dir, engine_core_process=True, **ARGS)
    try:
        assert _greedy(llm, [PROMPT], max_tokens=3, logits_processors=[force_42])[0][0] == 42
        with pytest.raises(InvalidParamError, match="importable module") as info:
            _greedy(llm, [PROMPT], logits_processors=[force_token(7)])  # a closure: no pickle
        assert info.value.param == "logits_processors"
    finally:
        llm.engine.shutdown()


def test_bad_words_outputs_are_batch_and_cache_invariant(llm):
    """The same greedy tokens alone, in a batch, and again with the prompt's blocks cached."""
    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(4)]
    plain = _greedy(llm, prompts, max_tokens=16)
    words = [_word_at(llm, tokens, 2)[1] for tokens in plain]
    together = _greedy(llm, prompts, max_tokens=16, bad_words=words)
    alone = [_greedy(llm, [p], max_tokens=16, bad_words=words)[0] for p in prompts]
    cached = _greedy(llm, prompts, max_tokens=16, bad_words=words)  # (the prompts' blocks are cached now)
    assert together == alone == cached and together != plain
