"""Vision-language models on tiny random weights, held to transformers on the same folder: the
encoder's output, greedy tokens and logprobs with images (chunked prefill cutting through them,
several a prompt, n > 1, preemption), prefix-cache hits on a repeated image and misses on another,
and the bad inputs an image prompt can bring."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from vlm_utils import MAX_TOKENS, hf_greedy, load_hf_llava, picture


@pytest.fixture(scope="module")
def hf_llava(llava_dir):
    return load_hf_llava(llava_dir)


PROMPTS = [
    ("USER: <image>\nWhat is in the picture? ASSISTANT:", [1]),
    ("USER: <image> or <image>, which is brighter? ASSISTANT:", [2, 3]),
    ("<image><image>", [3, 1]),  # two images abut: their placeholders are one run
]


def _generate(llm: LLM, prompts, params: SamplingParams | None = None):
    params = params or SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    requests = [{"prompt": p, "multi_modal_data": {"image": [picture(s) for s in seeds]}} for p, seeds in prompts]
    return llm.generate(requests, params, use_tqdm=False)


def test_the_vision_encoder_equals_transformers(llava_dir, hf_llava):
    from pagedllm.config import EngineArgs
    from pagedllm.engine.builder import load_config
    from pagedllm.models.loader import load_model

    model = load_model(load_config(EngineArgs(model=llava_dir, dtype="float32")), "cpu")
    hf, processor = hf_llava
    pixels = processor.image_processor(picture(5), return_tensors="np")["pixel_values"]
    with torch.no_grad():
        ours = model.encode_image({"pixel_values": pixels[0]})
        theirs = hf.model.get_image_features(torch.from_numpy(pixels), vision_feature_layer=-2)
    theirs = getattr(theirs, "pooler_output", theirs)
    torch.testing.assert_close(ours, torch.cat(list(theirs)).reshape(ours.shape), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [8, 2048], ids=["chunks-cut-through-images", "whole-prompts"])
def test_greedy_tokens_and_logprobs_equal_transformers(llava_dir, hf_llava, budget):
    llm = LLM(llava_dir, dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=budget)
    for output, (prompt, seeds) in zip(_generate(llm, PROMPTS), PROMPTS, strict=True):
        tokens, logprobs = hf_greedy(hf_llava, prompt, [picture(s) for s in seeds])
        sample = output.outputs[0]
        assert list(sample.token_ids) == tokens
        ours = [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)


def test_a_repeated_image_hits_the_prefix_cache_and_another_misses(llava_dir, hf_llava):
    llm = LLM(llava_dir, dtype="float32", max_model_len=256, block_size=4)
    prompt = "USER: <image>\nWhat is in the picture? Say it in a few words. ASSISTANT:"
    first = _generate(llm, [(prompt, [1])])[0].outputs[0].token_ids
    hits = llm.engine.stats().prefix_cache_hits
    again = _generate(llm, [(prompt, [1])])[0].outputs[0].token_ids
    repeat_hits = llm.engine.stats().prefix_cache_hits - hits
    other = _generate(llm, [(prompt, [4])])[0].outputs[0].token_ids
    other_hits = llm.engine.stats().prefix_cache_hits - hits - repeat_hits
    # Every full block of the repeat is a hit; the other image's blocks from its first on miss.
    num_tokens = len(hf_llava[1](text=prompt, images=[picture(1)])["input_ids"][0])
    offset = hf_llava[1](text=prompt, images=[picture(1)])["input_ids"][0].index(hf_llava[0].config.image_token_index)
    assert repeat_hits == (num_tokens - 1) // 4 * 4
    assert other_hits == offset // 4 * 4
    assert list(again) == list(first)
    assert list(other) == hf_greedy(hf_llava, prompt, [picture(4)])[0]
    encoder_cache = llm.engine.engine_core.core.scheduler.encoder_cache
    assert (encoder_cache.num_hits, encoder_cache.num_encoded) == (0, 2)  # the repeat's image was in cached blocks
    # The first image after other text: no block hits, but its encoder output is cached.
    moved = "Look. " + prompt
    assert list(_generate(llm, [(moved, [1])])[0].outputs[0].token_ids) == hf_greedy(hf_llava, moved, [picture(1)])[0]
    assert (encoder_cache.num_hits, encoder_cache.num_encoded) == (1, 2)
    stats = llm.engine.stats()
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits, stats.encoder_cache_entries) == (3, 1, 2)
    assert (stats.encoder_cache_used, stats.encoder_cache_size) == (8, 8 * 4)  # 2 images of 4; room for 8


def test_samples_and_preemption_keep_the_images(llava_dir, hf_llava):
    # 20 blocks of 4 tokens (2 KiB each) for 3 prompts of ~25 tokens and their samples' outputs:
    # some are preempted and recomputed.
    llm = LLM(llava_dir, dtype="float32", max_model_len=48, block_size=4, kv_cache_memory=str(20 * 2048))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    outputs = _generate(llm, PROMPTS, params)
    assert llm.engine.stats().num_preemptions > 0
    for output, (prompt, seeds) in zip(outputs, PROMPTS, strict=True):
        expected = hf_greedy(hf_llava, prompt, [picture(s) for s in seeds])[0]
        assert [list(s.token_ids) for s in output.outputs] == [expected, expected]


def test_bad_image_prompts_are_refused_by_name(llava_dir, llama_dir):
    llm = LLM(llava_dir, dtype="float32", max_model_len=256, limit_mm_per_prompt={"image": 1})
    cases = [
        ({"prompt": "<image><image>", "multi_modal_data": {"image": [picture(1), picture(2)]}}, "limit-mm-per-prompt"),
        ({"prompt": "<image>", "multi_modal_data": {"image": "picture.png"}}, "PIL images"),
        ({"prompt": "<image>", "multi_modal_data": {"video": [picture(1)]}}, "only 'image'"),
        ({"prompt": "no placeholder", "multi_modal_data": {"image": picture(1)}}, "image"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    ok = llm.generate([{"prompt": "<image>", "multi_modal_data": {"image": picture(1)}}], use_tqdm=False)
    assert ok[0].outputs[0].token_ids  # the engine goes on
    text_only = LLM(llama_dir, dtype="float32", max_model_len=128)
    with pytest.raises(ValueError, match="takes no images"):
        text_only.generate([{"prompt": "<image>", "multi_modal_data": {"image": picture(1)}}], use_tqdm=False)


def test_what_a_vision_language_model_does_not_take_yet_is_refused_at_start(llava_dir, llama_dir):
    with pytest.raises(ValueError, match="draft-model speculation does not take a vision-language model"):
        LLM(llava_dir, speculative_config={"method": "draft_model", "model": llama_dir, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="mm_encoder_cache_tokens .3. must hold an image: 4 embeddings"):
        LLM(llava_dir, mm_encoder_cache_tokens=3)
    with pytest.raises(ValueError, match="does not split over tensor-parallel ranks"):
        LLM(llava_dir, tensor_parallel_size=2)


def test_bf16_outputs_are_batch_and_chunk_invariant(llava_dir):
    """In bf16 (no oracle rounds alike): each prompt alone in whole steps gives bit for bit what it
    gives in a batch whose steps cut through its images, and again with its prefix cached."""
    batched = LLM(llava_dir, dtype="bfloat16", max_model_len=256, block_size=4, max_num_batched_tokens=8)
    together = _generate(batched, PROMPTS)
    cached = _generate(batched, PROMPTS)
    alone = LLM(llava_dir, dtype="bfloat16", max_model_len=256, block_size=4, enable_prefix_caching=False)
    for i, prompt in enumerate(PROMPTS):
        (single,) = _generate(alone, [prompt])
        for other in (together[i], cached[i]):
            assert list(other.outputs[0].token_ids) == list(single.outputs[0].token_ids)
            assert [e[t].logprob for e, t in zip(other.outputs[0].logprobs, other.outputs[0].token_ids)] == [
                e[t].logprob for e, t in zip(single.outputs[0].logprobs, single.outputs[0].token_ids)
            ]


@pytest.mark.parametrize(
    "topology", [{"engine_core_process": True}, {"data_parallel_size": 2}], ids=["core-process", "dp2"]
)
def test_images_cross_process_boundaries(llava_dir, hf_llava, topology):
    llm = LLM(llava_dir, dtype="float32", max_model_len=128, **topology)
    for output, (prompt, seeds) in zip(_generate(llm, PROMPTS), PROMPTS, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf_llava, prompt, [picture(s) for s in seeds])[0]


def test_chat_with_image_parts_equals_transformers(llava_dir, hf_llava, tmp_path):
    import base64
    import io

    from vlm_utils import CHAT_TEMPLATE

    buffer = io.BytesIO()
    picture(7).save(buffer, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    picture(8).save(tmp_path / "eight.png")
    llm = LLM(llava_dir, dtype="float32", max_model_len=256, allowed_local_media_path=str(tmp_path))
    content = [
        {"type": "image_pil", "image_pil": picture(6)},
        {"type": "text", "text": "Which differs,"},
        {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "text", "text": " or"},
        {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/eight.png"}},
        {"type": "text", "text": "?"},
    ]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (output,) = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False, chat_template=CHAT_TEMPLATE)
    text = "USER: <image>Which differs,<image> or<image>?\nASSISTANT:"
    images = [picture(6), picture(7), picture(8)]
    assert list(output.outputs[0].token_ids) == hf_greedy(hf_llava, text, images, add_special_tokens=False)[0]
    outside = [{"type": "image_url", "image_url": {"url": f"file://{tmp_path}/../x.png"}}]
    with pytest.raises(ValueError, match="outside --allowed-local-media-path"):
        llm.chat([{"role": "user", "content": outside}], params, use_tqdm=False, chat_template=CHAT_TEMPLATE)
