"""Sliding-window KV freeing on a tiny Mistral (window 8, blocks of 4): a long request holds about a
window of blocks, and what it generates is what transformers generates, on the C++ kernels and on
the torch path (which reads the freed entries' stale blocks and masks them); prefix hits, parallel
samples and beams over freed blocks give what the engine gives without freeing. And a tiny Gemma 3
(three sliding layers, one full): each group of layers has its own block tables, the sliding
groups holding a window's worth while the full group holds everything."""

from __future__ import annotations

import pytest
import torch

from conftest import greedy_without_kernels, hf_greedy, make_model
from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import cdiv
from test_gemma3 import make_gemma3

WINDOW, BLOCK = 8, 4
ARGS = dict(dtype="float32", block_size=BLOCK, kv_cache_memory="16MiB", max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, tokenizer_dir) -> str:
    return make_model("mistral", tmp_path_factory.mktemp("mistral"), tokenizer_dir)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tokenizer_dir) -> str:
    return make_gemma3(tmp_path_factory.mktemp("gemma3"), tokenizer_dir)


def managers(llm: LLM) -> list:
    kv = llm.engine.core.scheduler.kv
    return kv.groups if isinstance(kv, HybridKVCacheManager) else [kv]


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (70, 9, 41)]


def test_long_requests_hold_a_window_of_blocks_and_match_transformers(mistral):
    from transformers import AutoModelForCausalLM

    llm = LLM(mistral, **ARGS)
    core = llm.engine.core
    assert core.scheduler.kv.sliding_window == WINDOW
    held: list[int] = []
    step = core.step
    core.step = lambda: (
        step()
        if not held.append(
            max(
                (core.scheduler.kv.num_held_blocks(r.request_id) for r in core.scheduler.running),
                default=0,
            )
        )
        else None
    )
    hf = AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32).eval()
    batch = prompts(hf.config.vocab_size)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )
    for prompt, output in zip(batch, outputs):
        tokens, logprobs, _ = hf_greedy(hf, prompt, 30)
        assert output.outputs[0].token_ids == tokens
        ours = [e[t].logprob for e, t in zip(output.outputs[0].logprobs, tokens)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)
    # A request's blocks before a step: the window's, the block being filled, and a 32-token chunk's.
    assert 0 < max(held) <= cdiv(WINDOW, BLOCK) + 1 + cdiv(32, BLOCK)
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    # Without the C++ kernels (the torch reference attention reads whole tables): the same tokens.
    assert greedy_without_kernels(dict(model=mistral, **ARGS), batch, 30)[0] == [
        o.outputs[0].token_ids for o in outputs
    ]


def test_gemma3_groups_hold_their_own_blocks(gemma3):
    """Gemma 3's layers in groups with their own tables (here 3 sliding groups of one layer and one
    full group): at 100 tokens each sliding group holds a window's blocks, the full group all 25."""
    llm = LLM(gemma3, **ARGS)
    kv = llm.engine.core.scheduler.kv
    assert isinstance(kv, HybridKVCacheManager) and [g.sliding_window for g in kv.groups] == [WINDOW] * 3 + [None]
    core, held = llm.engine.core, []
    step = core.step
    core.step = lambda: (
        step()
        if not held.append([g.num_held_blocks(r.request_id) for g in kv.groups for r in core.scheduler.running])
        else None
    )
    llm.generate(
        [{"prompt_token_ids": prompts(llm.engine.model_config.vocab_size)[0]}],
        SamplingParams(temperature=0, max_tokens=31, ignore_eos=True),
        use_tqdm=False,
    )
    last = held[-1]  # before the last step: 100 tokens computed
    assert last[3] == cdiv(100, BLOCK) and all(n <= cdiv(WINDOW, BLOCK) + 1 for n in last[:3])


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_prefix_hits_samples_and_beams_over_freed_blocks(family, request):
    """The same work with the blocks behind the window kept: every output equal."""
    path = request.getfixturevalue(family)
    runs = []
    for free in (True, False):
        llm = LLM(path, **ARGS)
        for manager in managers(llm) if not free else ():
            manager.sliding_window = None
        vocab = llm.engine.model_config.vocab_size
        shared = prompts(vocab)[0]
        greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": shared}], greedy, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": shared + [5, 6, 7, 8, 9]}], greedy, use_tqdm=False)
        sampled = llm.generate(
            [{"prompt_token_ids": shared}],
            SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=15, ignore_eos=True),
            use_tqdm=False,
        )
        beams = llm.beam_search(
            [{"prompt_token_ids": shared[:30]}], BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
        )
        hits = llm.engine.stats().prefix_cache_hits
        runs.append(
            (
                [o.outputs[0].token_ids for o in first + again],
                [s.token_ids for s in sampled[0].outputs],
                [b.tokens for b in beams[0].sequences],
                hits,
            )
        )
    assert runs[0][:3] == runs[1][:3]
    assert runs[0][3] > 0  # the second prompt found blocks of the first (those still cached)
