"""Vision-language models on tiny random weights, held to transformers on the same folder: the
encoder's output, greedy tokens and logprobs with images (chunked prefill cutting through them,
several a prompt, n > 1, preemption), prefix-cache hits on a repeated image and misses on another,
and the bad inputs an image prompt can bring."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, tokenizer_dir) -> str:
    """LLaVA-1.5's shape in small: a 2-layer CLIP tower (28 px, 14 px patches: 4 tokens an image,
    the class token dropped), features from its last-but-one layer, a Llama of conftest's size."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    path = tmp_path_factory.mktemp("llava")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.2,
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        initializer_range=0.2,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=4,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    LlavaProcessor(
        images, tokenizer, patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1
    ).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_llava(llava_dir):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(llava_dir, backend="pil")


def picture(seed: int, size: tuple[int, int] = (40, 33)):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))


def hf_greedy(hf_llava, prompt: str, images: list) -> tuple[list[int], list[float]]:
    """Greedy tokens by full forward passes over the prompt and the image, and their logprobs."""
    model, processor = hf_llava
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    ids, tokens, logprobs = inputs["input_ids"], [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=ids, pixel_values=inputs["pixel_values"]).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs


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
