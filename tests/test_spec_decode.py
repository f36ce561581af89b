"""Speculative decoding: the n-gram proposer's contract, and verification in the model runner, whose
outputs with drafts are token for token those without (greedy and seeded sampling), on a tiny model."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.spec_decode.ngram import NgramProposer


def test_ngram_proposals():
    proposer = NgramProposer(k=3, min_n=2, max_n=3)
    assert proposer.propose([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]  # "2 3" occurred, followed by 4 5 9
    assert proposer.propose([1, 2, 3, 4, 1, 2, 3, 7, 1, 2, 3]) == [7, 1, 2]  # the latest occurrence
    assert proposer.propose([5, 6, 7, 8]) == []  # nothing repeats
    assert proposer.propose([1, 2, 1, 2], limit=1) == [1]
    assert proposer.propose([4, 4, 4, 4]) == [4]  # the continuation runs up to the end
    assert NgramProposer(k=2, min_n=1, max_n=1).propose([3, 8, 3]) == [8, 3]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=40), st.integers(1, 5), st.integers(1, 3), st.integers(0, 2))
def test_a_proposal_continues_an_earlier_occurrence_of_the_longest_suffix(tokens, k, min_n, extra):
    max_n = min_n + extra
    proposal = NgramProposer(k, min_n, max_n).propose(tokens)
    assert len(proposal) <= k
    found = [
        n
        for n in range(max_n, min_n - 1, -1)
        if len(tokens) > n and any(tokens[i : i + n] == tokens[-n:] for i in range(len(tokens) - n))
    ]
    if not found:
        assert proposal == []
        return
    n = found[0]
    start = max(i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]) + n
    assert proposal == tokens[start : start + k]


@pytest.mark.parametrize("bad", [dict(k=0), dict(k=2, min_n=0), dict(k=2, min_n=3, max_n=2)])
def test_bad_proposer_settings(bad):
    with pytest.raises(ValueError):
        NgramProposer(**bad)


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ARGS = dict(dtype="float32", kv_cache_memory="16MiB", block_size=4)


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves, so that n-gram drafts are proposed (and some accepted)."""
    import torch

    g = torch.Generator().manual_seed(7)
    pieces = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9, 3)]
    return [p * 4 for p in pieces] + [pieces[0] + pieces[1] + pieces[0]]


@pytest.fixture(scope="module")
def engines(llama_dir):
    from pagedllm import LLM

    return LLM(llama_dir, **ARGS), fixed_drafts(LLM(llama_dir, speculative_config=SPEC, **ARGS))


def fixed_drafts(llm):
    """Every request drafts up to k tokens every step: on a tiny model, whose steps are mostly
    per-row Python, the adaptive controller would rightly propose few."""
    llm.engine.core.controller = None
    return llm


def test_ngram_speculation_keeps_greedy_outputs(engines):
    from pagedllm import SamplingParams

    plain, spec = engines
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts(plain.engine.model_config.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    ours, theirs = (llm.generate(prompts, params, use_tqdm=False) for llm in (spec, plain))
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert [v.logprob for v in x.values()] == pytest.approx([v.logprob for v in y.values()], abs=1e-4)
    stats = spec.engine.stats()
    # Drafts were proposed and verified (whether the tiny random model's output copies its prompt
    # enough to accept them is up to it: the scripted test below makes sure some are).
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens


class ScriptedProposer:
    """Drafts from known outputs (those of the run without speculation), every third one made wrong,
    so that steps accept some drafts and reject others."""

    def __init__(self, sequences: list[list[int]], k: int = 3) -> None:
        self.sequences, self.k, self.calls = sequences, k, 0

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        n = len(token_ids)
        for sequence in self.sequences:
            if sequence[:n] == token_ids:
                drafts = sequence[n : n + min(self.k, limit if limit is not None else self.k)]
                self.calls += 1
                drafts = [t + 1 if (self.calls + i) % 3 == 0 else t for i, t in enumerate(drafts)]
                self.proposed += len(drafts)
                return drafts
        return []

    proposed = 0  # draft tokens handed out


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1),
        dict(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5),
        dict(temperature=1.0, seed=3, top_k=20, top_p=0.9, min_tokens=5, max_tokens=30, n=2),
        dict(temperature=0.8, seed=5, max_tokens=30, stop_token_ids=[]),
    ],
    ids=["greedy-logprobs", "seeded-penalties", "seeded-top-k-p-n2", "seeded-stop-ids"],
)
def test_verification_changes_no_output(engines, params):
    """Drafts partly right, partly wrong, verified in one step: every output is the one without
    speculation, greedy and seeded sampling alike (each token drawn from the target's distribution
    with the draw it had), logprobs too; rejected drafts' blocks are given back."""
    compare_with_scripted_drafts(*engines, [list(range(5 + i, 25 + 2 * i)) for i in range(4)], params)


def compare_with_scripted_drafts(plain, spec, prompts: list[list[int]], params: dict) -> None:
    """Generates with `plain`, then with `spec` drafting from plain's outputs (ScriptedProposer), and
    asserts the outputs equal, some drafts accepted and some rejected, every block given back."""
    from pagedllm import SamplingParams

    theirs = plain.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params), use_tqdm=False)
    if "stop_token_ids" in params:  # stop at tokens the unstopped run made, some inside accepted drafts
        stops = [o.outputs[0].token_ids[7] for o in theirs]
        params = {**params, "stop_token_ids": stops}
        theirs = plain.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params), use_tqdm=False)
    core = spec.engine.core
    ngram, core.proposer = (
        core.proposer,
        ScriptedProposer([p + o.token_ids for p, r in zip(prompts, theirs) for o in r.outputs]),
    )
    before = spec.engine.stats()
    try:
        ours = spec.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params), use_tqdm=False)
    finally:
        core.proposer = ngram
    for a, b in zip(ours, theirs):
        assert [(o.token_ids, o.finish_reason, o.stop_reason) for o in a.outputs] == [
            (o.token_ids, o.finish_reason, o.stop_reason) for o in b.outputs
        ]
        if params.get("logprobs") is not None:
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert x.keys() == y.keys()
                assert [v.logprob for v in x.values()] == pytest.approx([v.logprob for v in y.values()], abs=1e-4)
    after = spec.engine.stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert 0 < accepted < drafted
    assert sum(after.spec_accepted_per_position) == after.spec_num_accepted_tokens
    assert after.kv_blocks_free == after.kv_blocks_total


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=5)], ids=["greedy", "seeded"])
def test_constrained_requests_take_drafts_their_grammar_allows(engines, sampling):
    """JSON-schema requests with drafts: drafts the grammar refuses are cut before scheduling, the
    rest are verified against a mask row each (the matcher walked over the drafts, then rolled
    back); outputs are those without speculation, and valid."""
    import jsonschema

    from pagedllm import SamplingParams, StructuredOutputsParams
    from test_structured_output import SCHEMA

    plain, spec = engines
    params = SamplingParams(
        max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), **sampling
    )
    prompts = [list(range(9 + i, 30 + i)) for i in range(3)]
    theirs = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    core = spec.engine.core
    scripted = ScriptedProposer([p + r.outputs[0].token_ids for p, r in zip(prompts, theirs)])
    ngram, core.proposer = core.proposer, scripted
    before = spec.engine.stats()
    try:
        ours = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        core.proposer = ngram
    after = spec.engine.stats()
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(a.outputs[0].text), SCHEMA)
    verified = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens
    assert verified < scripted.proposed  # the grammar cut some wrong drafts before they cost a row
    assert after.kv_blocks_free == after.kv_blocks_total


@pytest.fixture(scope="module")
def bf16_engines(tmp_path_factory, tokenizer_dir):
    """bf16 engines on a model of head size 64, whose attention has the C++ AVX512-BF16 walks."""
    from conftest import make_model
    from pagedllm import LLM

    path = make_model(
        "llama", tmp_path_factory.mktemp("spec-bf16"), tokenizer_dir, hidden_size=256, intermediate_size=512
    )
    args = {**ARGS, "dtype": "bfloat16"}
    return LLM(path, **args), fixed_drafts(LLM(path, speculative_config=SPEC, **args))


def test_bf16_verification_changes_no_greedy_output(bf16_engines):
    """In bf16 a verification's positions compute as decode rows do (batch invariance), so
    near-ties tip as they do without drafts."""
    prompts = [list(range(5 + 3 * i, 60 + 5 * i)) for i in range(6)]
    compare_with_scripted_drafts(*bf16_engines, prompts, dict(temperature=0, max_tokens=48, ignore_eos=True))


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "unknown method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"model": "/no/such/draft", "num_speculative_tokens": 2}, "does not exist"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a 'model'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
            "prompt_lookup",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown keys"),
    ],
)
def test_bad_speculative_configs_stop_the_start(llama_dir, config, message):
    from pagedllm import LLM

    with pytest.raises(ValueError, match=message):
        LLM(llama_dir, speculative_config=config, **ARGS)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_server_streams_speculated_tokens_and_counts_them(llama_dir, engines, tmp_path, method):
    """`pagedllm serve --speculative-config`: a streamed greedy completion equals the offline one
    without speculation; /metrics counts drafts, draft tokens and accepted ones under vLLM's names.
    The draft model here is the target itself: every draft it makes is accepted."""
    import httpx
    from openai import OpenAI

    from pagedllm import SamplingParams
    from server_utils import Server

    plain, _ = engines
    prompt = repetitive_prompts(plain.engine.model_config.vocab_size)[0]
    expected = plain.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )
    server = Server(
        llama_dir,
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--block-size",
        "4",
        "--served-model-name",
        "tiny",
        "--speculative-config",
        json.dumps(SPEC if method == "ngram" else {"model": llama_dir, "num_speculative_tokens": 3}),
        log_path=str(tmp_path / "server.log"),
    )
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        chunks = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        metrics = httpx.get(f"{server.url}/metrics").text
        dashboard = httpx.get(f"{server.url}/dashboard/state").json()["replicas"][0]["stats"]
    finally:
        server.stop()
    assert text == expected[0].outputs[0].text
    counts = {
        line.split("{")[0]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("pagedllm:spec_decode")
    }
    assert counts["pagedllm:spec_decode_num_draft_tokens_total"] > 0
    assert counts["pagedllm:spec_decode_num_drafts_total"] > 0
    accepted, drafted = (
        counts["pagedllm:spec_decode_num_accepted_tokens_total"],
        counts["pagedllm:spec_decode_num_draft_tokens_total"],
    )
    if method == "draft_model":  # the draft is the target, greedy in fp32: every draft token is accepted
        assert accepted == drafted
    else:  # (a random model seldom continues the prompt's pattern: its drafts mostly fail)
        assert accepted <= drafted
    # The dashboard's acceptance is read from the same totals.
    assert (dashboard["spec_num_draft_tokens"], dashboard["spec_num_accepted_tokens"]) == (
        counts["pagedllm:spec_decode_num_draft_tokens_total"],
        counts["pagedllm:spec_decode_num_accepted_tokens_total"],
    )
    per_position = {
        int(line.split('position="')[1].split('"')[0]): float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("pagedllm:spec_decode_num_accepted_tokens_per_pos_total")
    }
    assert sum(per_position.values()) == counts["pagedllm:spec_decode_num_accepted_tokens_total"]
    # A draft's token j is accepted only after token j - 1 was.
    assert all(per_position[j] <= per_position[j - 1] for j in per_position if j)
