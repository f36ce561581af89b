"""Vision-language models on tiny random weights, held to transformers on the same folder: the
encoder's output, greedy tokens and logprobs with images (chunked prefill cutting through them,
several a prompt, n > 1, preemption), prefix-cache hits on a repeated image and misses on another,
and the bad inputs an image prompt can bring. Each family: LLaVA-1.5 (a fixed number of tokens an
image), Qwen2-VL (each image's own resolution and token count, M-RoPE), Gemma 3 (an image's tokens
attend to each other both ways: no step cuts through one)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pagedllm import LLM, SamplingParams
from vlm_utils import (
    GEMMA3_IMAGE,
    MAX_TOKENS,
    QWEN2_VL_IMAGE,
    hf_greedy,
    load_hf_gemma3,
    load_hf_llava,
    load_hf_qwen2_vl,
    picture,
)


@dataclass
class Family:
    path: str
    hf: tuple  # transformers' model and processor
    image: str  # one image's placeholder in a prompt

    def prompt(self, template: str) -> str:
        return template.format(img=self.image)

    def image_tokens(self, prompt: str, images: list) -> list[int]:
        """Where the processor puts the images' placeholder tokens."""
        ids = self.hf[1](text=prompt, images=images)["input_ids"][0]
        return [i for i, t in enumerate(ids) if t == self.hf[0].config.image_token_id]


FAMILIES = {
    "llava": ("llava_dir", load_hf_llava, "<image>"),
    "qwen2_vl": ("qwen2_vl_dir", load_hf_qwen2_vl, QWEN2_VL_IMAGE),
    "gemma3": ("gemma3_vl_dir", load_hf_gemma3, GEMMA3_IMAGE),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def vlm(request) -> Family:
    fixture, load, placeholder = FAMILIES[request.param]
    path = request.getfixturevalue(fixture)
    return Family(path, load(path), placeholder)


@pytest.fixture(scope="module")
def hf_llava(llava_dir):
    return load_hf_llava(llava_dir)


# Pictures of several sizes: Qwen2-VL gives each its own grid (40x33 px: 6 tokens, 90x64: 12, 20x100: 8).
SIZES = {1: (40, 33), 2: (90, 64), 3: (20, 100), 4: (40, 33)}
PROMPTS = [
    ("USER: {img}\nWhat is in the picture? ASSISTANT:", [1]),
    ("USER: {img} or {img}, which is brighter? ASSISTANT:", [2, 3]),
    ("{img}{img}", [3, 1]),  # two images abut: their placeholders are one run
]


def _pictures(seeds: list[int]) -> list:
    return [picture(s, SIZES.get(s, (40, 33))) for s in seeds]


def _generate(llm: LLM, vlm: Family, prompts, params: SamplingParams | None = None):
    params = params or SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    requests = [{"prompt": vlm.prompt(p), "multi_modal_data": {"image": _pictures(seeds)}} for p, seeds in prompts]
    return llm.generate(requests, params, use_tqdm=False)


def _expected(vlm: Family, template: str, seeds: list[int]) -> tuple[list[int], list[float]]:
    return hf_greedy(vlm.hf, vlm.prompt(template), _pictures(seeds))


def test_the_vision_encoder_equals_transformers(vlm):
    from pagedllm.config import EngineArgs
    from pagedllm.engine.builder import load_config
    from pagedllm.models.loader import load_model

    model = load_model(load_config(EngineArgs(model=vlm.path, dtype="float32")), "cpu")
    hf, processor = vlm.hf
    for seed in (2, 3):
        inputs = processor.image_processor(_pictures([seed]), return_tensors="np")
        pixels = torch.from_numpy(inputs["pixel_values"])
        with torch.no_grad():
            if "image_grid_thw" in inputs:
                grid = inputs["image_grid_thw"]
                ours = model.encode_image({"pixel_values": inputs["pixel_values"], "image_grid_thw": grid[0]})
                theirs = hf.model.get_image_features(pixels, torch.from_numpy(grid))
            else:
                ours = model.encode_image({"pixel_values": inputs["pixel_values"][0]})
                layer = {"vision_feature_layer": -2} if hf.config.model_type == "llava" else {}
                theirs = hf.model.get_image_features(pixels, **layer)
        theirs = getattr(theirs, "pooler_output", theirs)
        torch.testing.assert_close(ours, torch.cat(list(theirs)).reshape(ours.shape), atol=1e-5, rtol=1e-5)


def test_m_rope_positions_equal_transformers(qwen2_vl_dir):
    """Qwen2-VL's three rotary positions of a prompt with images of different grids, and the offset
    its generated tokens take, from the engine's features as transformers' get_rope_index has them."""
    from pagedllm.config import EngineArgs
    from pagedllm.engine.builder import load_config
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.models.loader import load_model
    from pagedllm.multimodal.processing import ImagePrompt

    args = EngineArgs(model=qwen2_vl_dir, dtype="float32")
    model = load_model(load_config(args), "cpu")
    hf, processor = load_hf_qwen2_vl(qwen2_vl_dir)
    text = f"A {QWEN2_VL_IMAGE} then {QWEN2_VL_IMAGE}{QWEN2_VL_IMAGE} and text."
    images = _pictures([2, 3, 1])
    token_ids, features = LLMEngine(args).images(ImagePrompt(text, tuple(images)))
    inputs = processor(text=text, images=images, return_tensors="pt")
    assert token_ids == inputs["input_ids"][0].tolist()
    positions, delta = hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    ours = model.rope_positions(features, len(token_ids))
    assert ours.prompt.tolist() == positions[:, 0].tolist()
    assert ours.delta == int(delta) < 0


@pytest.mark.parametrize("budget", [8, 2048], ids=["chunks-cut-through-images", "whole-prompts"])
def test_greedy_tokens_and_logprobs_equal_transformers(vlm, budget):
    llm = LLM(vlm.path, dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=budget)
    for output, (template, seeds) in zip(_generate(llm, vlm, PROMPTS), PROMPTS, strict=True):
        tokens, logprobs = _expected(vlm, template, seeds)
        sample = output.outputs[0]
        assert list(sample.token_ids) == tokens
        ours = [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)


def test_a_repeated_image_hits_the_prefix_cache_and_another_misses(vlm):
    llm = LLM(vlm.path, dtype="float32", max_model_len=256, block_size=4)
    template = "USER: {img}\nWhat is in the picture? Say it in a few words. ASSISTANT:"
    first = _generate(llm, vlm, [(template, [1])])[0].outputs[0].token_ids
    hits = llm.engine.stats().prefix_cache_hits
    again = _generate(llm, vlm, [(template, [1])])[0].outputs[0].token_ids
    repeat_hits = llm.engine.stats().prefix_cache_hits - hits
    other = _generate(llm, vlm, [(template, [4])])[0].outputs[0].token_ids
    other_hits = llm.engine.stats().prefix_cache_hits - hits - repeat_hits
    # Every full block of the repeat is a hit; the other image's blocks from its first on miss.
    prompt = vlm.prompt(template)
    num_tokens = len(vlm.hf[1](text=prompt, images=_pictures([1]))["input_ids"][0])
    placeholders = vlm.image_tokens(prompt, _pictures([1]))
    assert repeat_hits == (num_tokens - 1) // 4 * 4
    assert other_hits == placeholders[0] // 4 * 4
    assert list(again) == list(first)
    assert list(other) == _expected(vlm, template, [4])[0]
    encoder_cache = llm.engine.engine_core.core.scheduler.encoder_cache
    assert (encoder_cache.num_hits, encoder_cache.num_encoded) == (0, 2)  # the repeat's image was in cached blocks
    # The first image after other text: no block hits, but its encoder output is cached.
    moved = "Look. " + template
    assert list(_generate(llm, vlm, [(moved, [1])])[0].outputs[0].token_ids) == _expected(vlm, moved, [1])[0]
    assert (encoder_cache.num_hits, encoder_cache.num_encoded) == (1, 2)
    stats = llm.engine.stats()
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits, stats.encoder_cache_entries) == (3, 1, 2)
    largest = {"llava": 4, "qwen2_vl": 16, "gemma3": 4}[vlm.hf[0].config.model_type]  # (112x112 px for Qwen2-VL)
    # Two images' rows held; room for 8 of the largest.
    assert (stats.encoder_cache_used, stats.encoder_cache_size) == (2 * len(placeholders), 8 * largest)


def test_image_blocks_come_back_from_the_disk_tier_after_a_restart(vlm, tmp_path):
    """--kv-offload-dir: a restarted engine reads an image prompt's blocks back (its greedy tokens
    transformers'), and another image in the same text never hits past it."""
    template = "USER: {img}\nWhat is in the picture? Say it in a few words. ASSISTANT:"
    args = {"dtype": "float32", "max_model_len": 256, "block_size": 4, "kv_offload_dir": str(tmp_path)}
    first = LLM(vlm.path, **args)
    _generate(first, vlm, [(template, [1])])
    first.engine.shutdown()
    again = LLM(vlm.path, **args)
    assert list(_generate(again, vlm, [(template, [1])])[0].outputs[0].token_ids) == _expected(vlm, template, [1])[0]
    hits = again.engine.stats().kv_tier_hits
    assert hits > 0
    assert list(_generate(again, vlm, [(template, [4])])[0].outputs[0].token_ids) == _expected(vlm, template, [4])[0]
    placeholders = vlm.image_tokens(vlm.prompt(template), _pictures([4]))
    assert again.engine.stats().kv_tier_hits - hits <= placeholders[0] // 4  # the text before the image, at most
    again.engine.shutdown()


def test_samples_and_preemption_keep_the_images(vlm):
    # 20 blocks of 4 tokens (2 KiB each) for 3 prompts of 20-40 tokens and their samples' outputs:
    # some are preempted and recomputed.
    llm = LLM(vlm.path, dtype="float32", max_model_len=64, block_size=4, kv_cache_memory=str(20 * 2048))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    outputs = _generate(llm, vlm, PROMPTS, params)
    assert llm.engine.stats().num_preemptions > 0
    for output, (template, seeds) in zip(outputs, PROMPTS, strict=True):
        expected = _expected(vlm, template, seeds)[0]
        assert [list(s.token_ids) for s in output.outputs] == [expected, expected]


def test_bad_image_prompts_are_refused_by_name(vlm, llama_dir):
    llm = LLM(vlm.path, dtype="float32", max_model_len=256, limit_mm_per_prompt={"image": 1})
    two, one = vlm.prompt("{img}{img}"), vlm.prompt("{img}")
    cases = [
        ({"prompt": two, "multi_modal_data": {"image": [picture(1), picture(2)]}}, "limit-mm-per-prompt"),
        ({"prompt": one, "multi_modal_data": {"image": "picture.png"}}, "PIL images"),
        ({"prompt": one, "multi_modal_data": {"video": [picture(1)]}}, "only 'image'"),
        ({"prompt": "no placeholder", "multi_modal_data": {"image": picture(1)}}, "0 image placeholders"),
        ({"prompt": two, "multi_modal_data": {"image": [picture(1)]}}, "2 image placeholders"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    ok = llm.generate([{"prompt": one, "multi_modal_data": {"image": picture(1)}}], use_tqdm=False)
    assert ok[0].outputs[0].token_ids  # the engine goes on
    text_only = LLM(llama_dir, dtype="float32", max_model_len=128)
    with pytest.raises(ValueError, match="takes no images"):
        text_only.generate([{"prompt": one, "multi_modal_data": {"image": picture(1)}}], use_tqdm=False)


def test_what_a_vision_language_model_does_not_take_yet_is_refused_at_start(llava_dir, gemma3_vl_dir, llama_dir):
    with pytest.raises(ValueError, match="draft-model speculation does not take a vision-language model"):
        LLM(llava_dir, speculative_config={"method": "draft_model", "model": llama_dir, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="mm_encoder_cache_tokens .3. must hold an image: 4 embeddings"):
        LLM(llava_dir, mm_encoder_cache_tokens=3)
    with pytest.raises(ValueError, match="does not split over tensor-parallel ranks"):
        LLM(llava_dir, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(3\) must hold an image's 4 tokens"):
        LLM(gemma3_vl_dir, max_num_batched_tokens=3)


def test_bf16_outputs_are_batch_and_chunk_invariant(vlm):
    """In bf16 (no oracle rounds alike): each prompt alone in whole steps gives bit for bit what it
    gives in a batch whose steps cut through its images, and again with its prefix cached."""
    batched = LLM(vlm.path, dtype="bfloat16", max_model_len=256, block_size=4, max_num_batched_tokens=8)
    together = _generate(batched, vlm, PROMPTS)
    cached = _generate(batched, vlm, PROMPTS)
    alone = LLM(vlm.path, dtype="bfloat16", max_model_len=256, block_size=4, enable_prefix_caching=False)
    for i, prompt in enumerate(PROMPTS):
        (single,) = _generate(alone, vlm, [prompt])
        for other in (together[i], cached[i]):
            assert list(other.outputs[0].token_ids) == list(single.outputs[0].token_ids)
            assert [e[t].logprob for e, t in zip(other.outputs[0].logprobs, other.outputs[0].token_ids)] == [
                e[t].logprob for e, t in zip(single.outputs[0].logprobs, single.outputs[0].token_ids)
            ]


@pytest.mark.parametrize(
    "topology", [{"engine_core_process": True}, {"data_parallel_size": 2}], ids=["core-process", "dp2"]
)
def test_images_cross_process_boundaries(vlm, topology):
    llm = LLM(vlm.path, dtype="float32", max_model_len=128, **topology)
    for output, (template, seeds) in zip(_generate(llm, vlm, PROMPTS), PROMPTS, strict=True):
        assert list(output.outputs[0].token_ids) == _expected(vlm, template, seeds)[0]


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
