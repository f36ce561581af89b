"""The sampler on hand-made logits, and sampling behaviour through the engine."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_ops
from pagedllm.worker.input_batch import RequestState
from pagedllm.worker.sampler import Sampler, apply_penalties, greedy_tokens

VOCAB = 8


def _req(params: SamplingParams, prompt=(1,), output=(), rid="r") -> RequestState:
    return RequestState(rid, params, frozenset({2}), len(prompt), list(prompt) + list(output))


def _draws(logits: list[float], params: SamplingParams, times: int = 300) -> set[int]:
    sampler = Sampler()
    batch = torch.tensor([logits] * times)
    out = sampler(batch, [_req(params, rid=str(i)) for i in range(times)])
    return set(out.token_ids)


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0]).clamp_min(1e-12).log().tolist()


@pytest.mark.skipif(cpu_ops() is None, reason="no C++ toolchain")
@pytest.mark.parametrize("vocab", [1, 5, 63, 64, 65, 32000])
def test_greedy_tokens_is_torch_argmax_with_its_ties_infinities_and_nans(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g)
    logits[1] = logits[1].round()  # many ties: the first index wins
    logits[2] = float("-inf")
    logits[3, -1] = float("inf")
    logits[4, vocab // 2] = float("nan")
    logits[5, :] = 0.0
    logits[5, vocab - 1] = -0.0  # equal to 0.0: still the first index
    logits[6, ::2] = float("nan")
    logits[7] = logits[7].bfloat16().float()  # coarse values tie more often
    logits[8, vocab // 3 :] = logits[8].max()  # the max again, late in the row
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


def test_draws_follow_the_distribution():
    sampler = Sampler()
    rows = 6000
    out = sampler(
        torch.tensor([PROBS] * rows), [_req(SamplingParams(temperature=1.0), rid=str(i)) for i in range(rows)]
    )
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB).float() / rows
    want = torch.tensor(PROBS).exp()
    assert (freq - want).abs().max() < 0.025, freq  # ~4 standard errors at p = 0.5
    assert freq[4:].sum() == 0  # tokens of probability ~0 are never drawn


def test_top_k_never_emits_excluded_tokens():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)).tolist()
    allowed = set(torch.tensor(logits).topk(3).indices.tolist())
    seen = _draws(logits, SamplingParams(temperature=5.0, top_k=3))
    assert seen <= allowed and len(seen) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert _draws(PROBS, SamplingParams(top_p=0.7)) == {0, 1}


def test_min_p_drops_tokens_below_share_of_the_best():
    assert _draws(PROBS, SamplingParams(min_p=0.2)) == {0, 1, 2}


def test_greedy_with_logit_bias_and_allowed_tokens():
    sampler = Sampler()
    logits = torch.tensor([PROBS, PROBS, PROBS])
    reqs = [
        _req(SamplingParams(temperature=0)),
        _req(SamplingParams(temperature=0, logit_bias={3: 100.0})),
        _req(SamplingParams(temperature=0, allowed_token_ids=[2, 5])),
    ]
    assert sampler(logits, reqs).token_ids == [0, 3, 2]


def test_min_tokens_bars_eos_and_stop_tokens():
    logits = torch.zeros(VOCAB)
    logits[2], logits[4], logits[5] = 10.0, 9.0, 8.0  # 2 is EOS, 4 a stop token
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4])
    out = Sampler()(logits[None].clone(), [_req(params, output=(7,))])
    assert out.token_ids == [5]
    out = Sampler()(logits[None].clone(), [_req(params, output=(7, 7, 7))])
    assert out.token_ids == [2]


def test_penalties_match_their_formulas():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0, 0.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    req = _req(params, prompt=(0, 1), output=(2, 2, 3))
    got = apply_penalties(logits.clone(), [req])[0]
    expected = logits[0].clone()
    expected[0] = 2.0 / 2  # prompt token, positive: divided
    expected[1] = -2.0 * 2  # prompt token, negative: multiplied
    expected[2] = 1.0 / 2 - 0.5 * 2 - 0.25  # output twice: repetition, frequency x2, presence
    expected[3] = -1.0 * 2 - 0.5 * 1 - 0.25
    torch.testing.assert_close(got, expected)


def test_seeded_sampling_is_reproducible(llama_dir):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB")
    prompts = ["Hello there", "The weather today"]

    def run(seed):
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=12, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    first = run(7)
    # Unseeded traffic in between must not disturb seeded requests.
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=5), use_tqdm=False)
    assert run(7) == first
    assert run(8) != first
    n_samples = llm.generate(["Hello"], SamplingParams(n=3, seed=1, max_tokens=8, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs
    assert [s.index for s in n_samples] == [0, 1, 2]
    assert len({tuple(s.token_ids) for s in n_samples}) > 1


def test_stop_strings_and_stop_tokens(llama_dir):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB")
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    free = llm.generate(["Hello there"], base, use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 4]  # most likely spans a token boundary
    cut = text.index(stop)
    stopped = llm.generate(
        ["Hello there"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert (stopped.text, stopped.finish_reason, stopped.stop_reason) == (text[:cut], "stop", stop)
    kept = llm.generate(
        ["Hello there"],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept[0].outputs[0].text == text[: cut + len(stop)]
    token = free.token_ids[4]
    by_token = llm.generate(
        ["Hello there"],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[token]),
        use_tqdm=False,
    )[0].outputs[0]
    first = free.token_ids.index(token)
    assert by_token.token_ids == free.token_ids[: first + 1]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", token)


@pytest.mark.parametrize(
    "bad",
    [
        dict(n=0),
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(min_p=2),
        dict(max_tokens=-1),
        dict(presence_penalty=3),
        dict(repetition_penalty=0),
        dict(min_tokens=5, max_tokens=2),
        dict(logprobs=-1),
        dict(stop=[""]),
        dict(allowed_token_ids=[]),
    ],
)
def test_invalid_sampling_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("seeds", [(-1, 2**63 - 1, 2**64 - 1, 2**64 + 2**32 - 1, 2**200 - 1)])
def test_seeds_differing_above_32_bits_draw_differently(seeds):
    """torch's CPU generator keeps a seed's low 32 bits: all of these once drew the same tokens."""
    vocab = 4096
    flat = torch.zeros(vocab).tolist()

    def draws(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed)
        rows = [_req(params, output=(5,) * i, rid=f"{seed}-{i}") for i in range(8)]  # output indices 0..7
        return Sampler()(torch.tensor([flat] * len(rows)), rows).token_ids

    sequences = [draws(seed) for seed in seeds]
    assert len({tuple(s) for s in sequences}) == len(seeds)
    assert draws(seeds[0]) == sequences[0]  # and the same seed draws the same again


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    assert _draws(PROBS, SamplingParams(temperature=1.0, top_k=2**40)) == {0, 1, 2, 3}


def test_token_bitmask_limits_what_is_sampled_and_leaves_logprobs_alone():
    from pagedllm.core.step import TokenBitmask

    vocab = 70  # three 32-bit words, the last one partly past the vocabulary
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    allowed = [3, 33, 65]
    greedy = SamplingParams(temperature=0, logprobs=1)
    rows = [_req(greedy, rid="masked"), _req(greedy, rid="free"), _req(SamplingParams(temperature=1.0), rid="drawn")]
    mask = TokenBitmask({"masked": 0, "drawn": 1}, [TokenBitmask.pack(allowed, vocab)] * 2)
    out = Sampler()(logits.repeat(3, 1), rows, mask)
    best_allowed = max(allowed, key=lambda t: logits[t])
    assert out.token_ids[0] == best_allowed and out.token_ids[1] == int(logits.argmax())
    assert out.token_ids[2] in allowed
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[0].logprobs[0] == pytest.approx(float(raw[best_allowed]), abs=1e-5)  # the model's, unmasked
    draws = Sampler()(
        logits.repeat(200, 1),
        [_req(SamplingParams(temperature=2.0), rid=str(i)) for i in range(200)],
        TokenBitmask({str(i): 0 for i in range(200)}, [TokenBitmask.pack(allowed, vocab)]),
    )
    assert set(draws.token_ids) <= set(allowed) and len(set(draws.token_ids)) > 1
    everything = TokenBitmask({"masked": 0}, [TokenBitmask.pack(list(range(vocab)), vocab)])
    assert Sampler()(logits[None].clone(), rows[:1], everything).token_ids == [int(logits.argmax())]


def test_token_mask_kernel_equals_the_torch_path(monkeypatch):
    """The C++ mask (all-allowed words skipped, all-barred filled whole) bars exactly the tokens the
    portable path bars, high bits and a partial last word included."""
    import numpy as np

    from pagedllm.core.step import TokenBitmask
    from pagedllm.kernels import cpu_ops
    from pagedllm.worker import sampler
    from pagedllm.worker.sampler import apply_token_bitmask

    if cpu_ops() is None:
        pytest.skip("no C++ kernels here")
    vocab, batch = 1000, 6
    rng = np.random.default_rng(1)
    words = rng.integers(-(2**31), 2**31 - 1, size=(4, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    words[0, :10] = -1
    words[1, 5:] = 0
    words[2, :] = -1
    words[3, :] = 0
    words[3, 3] = np.int32(-(2**31))  # only token 3 * 32 + 31
    states = [_req(SamplingParams(), rid=str(i)) for i in range(batch)]
    mask = TokenBitmask({"4": 0, "1": 1, "5": 2, "2": 3}, words)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(2))
    with_kernel = apply_token_bitmask(logits.clone(), states, mask)
    monkeypatch.setattr(sampler, "cpu_ops", lambda: None)
    portable = apply_token_bitmask(logits.clone(), states, mask)
    assert torch.equal(with_kernel, portable)
    barred = torch.isinf(portable)
    assert not barred[[0, 3]].any() and not barred[5].any() and barred[1, 5 * 32 :].all()
    assert barred[2].sum() == vocab - 1 and not barred[2, 3 * 32 + 31]


def test_bad_words_bar_a_words_end_after_its_start_in_the_output_only():
    from pagedllm.worker.sampler import apply_logit_controls

    params = SamplingParams(temperature=0, bad_words_token_ids=[[3, 4], [6]])

    def barred(prompt, output) -> set[int]:
        logits = apply_logit_controls(torch.zeros(1, VOCAB), [_req(params, prompt, output)])
        return {t for t in range(VOCAB) if logits[0, t] == float("-inf")}

    assert barred((1,), ()) == {6}  # a one-token word always
    assert barred((1, 3), ()) == {6}  # the prompt's 3 does not start the word
    assert barred((1,), (3,)) == {4, 6}
    assert barred((1,), (3, 5)) == {6}
