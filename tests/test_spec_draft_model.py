"""Draft-model speculation: a second model proposes, the target verifies; greedy outputs are the
target's own, random ones follow the target's distribution (rejection sampling), seeded ones repeat."""

from __future__ import annotations

import collections

import pytest
import torch

ARGS = dict(dtype="float32", kv_cache_memory="16MiB", block_size=4)
K = 3


def perturbed_copy(source: str, path, scale: float) -> str:
    """The same model with noise on every weight: a draft that agrees with it often, not always."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * scale * param.std())
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def draft_dir(llama_dir, tmp_path_factory) -> str:
    return perturbed_copy(llama_dir, tmp_path_factory.mktemp("draft"), scale=0.1)


def fixed_drafts(llm):
    """Every request drafts k tokens (the adaptive controller would propose few on a tiny model)."""
    llm.engine.core.controller = None
    return llm


@pytest.fixture(scope="module")
def engines(llama_dir, draft_dir):
    from pagedllm import LLM

    spec = {"model": draft_dir, "num_speculative_tokens": K}
    return LLM(llama_dir, **ARGS), fixed_drafts(LLM(llama_dir, speculative_config=spec, **ARGS))


def prompts(count: int = 4) -> list[dict]:
    return [{"prompt_token_ids": list(range(5 + 3 * i, 30 + 2 * i))} for i in range(count)]


def test_greedy_outputs_and_logprobs_are_the_targets(engines):
    from pagedllm import SamplingParams

    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2, n=2)
    before = spec.engine.stats()
    theirs, ours = (llm.generate(prompts(), params, use_tqdm=False) for llm in (plain, spec))
    for a, b in zip(ours, theirs):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            for p, q in zip(x.logprobs, y.logprobs):
                assert p.keys() == q.keys()
                assert [v.logprob for v in p.values()] == pytest.approx([v.logprob for v in q.values()], abs=1e-4)
    after = spec.engine.stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert 0 < accepted < drafted  # the perturbed draft agrees often, not always
    assert after.kv_blocks_free == after.kv_blocks_total


def test_the_target_as_its_own_draft_accepts_everything(llama_dir):
    from pagedllm import LLM, SamplingParams

    llm = fixed_drafts(LLM(llama_dir, speculative_config={"model": llama_dir, "num_speculative_tokens": K}, **ARGS))
    for params in (
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, max_tokens=25, ignore_eos=True),
    ):
        llm.generate(prompts(), params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_rejection_sampled_tokens_carry_the_targets_logprobs(engines):
    """Tokens from rejection sampling (accepted drafts and residual draws) report the target's
    logprobs: the plain engine scores the same text alike."""
    from pagedllm import SamplingParams

    plain, spec = engines
    ours = spec.generate(
        prompts(2), SamplingParams(temperature=1.0, seed=2, max_tokens=20, ignore_eos=True, logprobs=1), use_tqdm=False
    )
    for prompt, output in zip(prompts(2), ours):
        sample = output.outputs[0]
        scored = plain.generate(
            [{"prompt_token_ids": prompt["prompt_token_ids"] + sample.token_ids}],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )[0]
        n = len(prompt["prompt_token_ids"])
        for token, entry, reference in zip(sample.token_ids, sample.logprobs, scored.prompt_logprobs[n:]):
            assert entry[token].logprob == pytest.approx(reference[token].logprob, abs=1e-4)


def test_seeded_requests_repeat_and_unseeded_ones_differ(engines):
    from pagedllm import SamplingParams

    _, spec = engines
    seeded = SamplingParams(temperature=1.0, seed=9, top_p=0.9, max_tokens=30, ignore_eos=True)
    first, again = (spec.generate(prompts(), seeded, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    free = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    a, b = (spec.generate(prompts(), free, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in b]


def test_preemption_leaves_outputs_unchanged(llama_dir, draft_dir):
    """A KV cache too small for all at once: requests are preempted, resumed, and recomputed (the
    draft's K/V too, from the start); greedy outputs stay the target's."""
    from pagedllm import LLM, SamplingParams

    # Prompt chunks of 16 tokens too: the draft catches up on whatever the target computed.
    tight = dict(ARGS, kv_cache_memory=f"{40 * 2 * 2048}", max_model_len=96, max_num_batched_tokens=16)
    plain = LLM(llama_dir, **tight)
    spec = fixed_drafts(LLM(llama_dir, speculative_config={"model": draft_dir, "num_speculative_tokens": K}, **tight))
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    theirs, ours = (llm.generate(prompts(6), params, use_tqdm=False) for llm in (plain, spec))
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


# Chi-square critical value at p = 0.001 for 24 degrees of freedom (25 joint bins).
CHI2_24_999 = 51.18


@pytest.mark.slow
def test_sampled_tokens_follow_the_targets_distribution(engines):
    """The first two sampled tokens of many seeded requests at temperature 1, top-k 5: the second
    is a draft verified by rejection sampling. Their joint frequencies match the target's joint
    distribution p(a) p(b | a) (from the plain engine's logprobs) within a chi-square bound; the
    draft's own distribution is far from it (the bound tells them apart)."""
    from pagedllm import SamplingParams

    plain, spec = engines
    prompt = list(range(40, 52))

    def top5(tokens: list[int]) -> dict[int, float]:
        out = (
            plain.generate(
                [{"prompt_token_ids": tokens}], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False
            )[0]
            .outputs[0]
            .logprobs[0]
        )
        weights = {t: torch.tensor(v.logprob).exp().item() for t, v in out.items() if v.rank <= 5}
        total = sum(weights.values())
        return {t: w / total for t, w in weights.items()}

    first = top5(prompt)
    expected = {(a, b): pa * pb for a, pa in first.items() for b, pb in top5(prompt + [a]).items()}
    trials = 2000
    params = [SamplingParams(temperature=1.0, top_k=5, seed=i, max_tokens=3, ignore_eos=True) for i in range(trials)]
    before = spec.engine.stats()
    outputs = spec.generate([{"prompt_token_ids": prompt}] * trials, params, use_tqdm=False)
    after = spec.engine.stats()
    assert after.spec_num_draft_tokens - before.spec_num_draft_tokens >= trials  # every second token was a draft
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert 0 < accepted < after.spec_num_draft_tokens - before.spec_num_draft_tokens
    counts = collections.Counter(tuple(o.outputs[0].token_ids[:2]) for o in outputs)
    assert set(counts) <= set(expected)  # never a pair the target cannot draw
    stat = sum((counts.get(pair, 0) - trials * p) ** 2 / (trials * p) for pair, p in expected.items())
    assert stat < CHI2_24_999, (stat, counts)


def test_a_draft_with_another_vocabulary_stops_the_start(llama_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedllm import LLM

    config = AutoConfig.from_pretrained(llama_dir)
    config.vocab_size = 1000
    other = str(tmp_path / "small-vocab")
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(llama_dir, speculative_config={"model": other, "num_speculative_tokens": 2}, **ARGS)


def test_constrained_requests_take_the_drafts_their_grammar_allows(engines):
    """JSON-schema requests with a draft model: its drafts (drawn without the grammar, as vLLM's
    drafters do) are cut where the grammar refuses one and the rest verified against a mask row
    each; outputs equal the plain engine's (greedy) and are valid."""
    import json

    import jsonschema

    from pagedllm import SamplingParams, StructuredOutputsParams
    from test_structured_output import SCHEMA

    plain, spec = engines
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    before = spec.engine.stats()
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        params = SamplingParams(max_tokens=80, structured_outputs=constraint, **sampling)
        theirs, ours = (llm.generate(prompts(3), params, use_tqdm=False) for llm in (plain, spec))
        for a, b in zip(ours, theirs):
            assert a.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(a.outputs[0].text), SCHEMA)
            if not sampling.get("seed"):  # greedy: the target's own output (seeded draws differ by design)
                assert a.outputs[0].token_ids == b.outputs[0].token_ids
    after = spec.engine.stats()
    assert after.spec_num_draft_tokens > before.spec_num_draft_tokens  # some drafts got through the grammar
    assert after.kv_blocks_free == after.kv_blocks_total
