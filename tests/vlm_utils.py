"""A tiny LLaVA (conftest's llava_dir writes it once a session) and transformers' greedy tokens on it."""

from __future__ import annotations

import numpy as np
import torch

MAX_TOKENS = 8
# A LLaVA-style chat template that takes OpenAI's content parts (images as {"type": "image"}).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role | upper }}: "
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def make_llava(path, tokenizer_dir: str) -> str:
    """LLaVA-1.5's shape in small: a 3-layer CLIP tower (28 px, 14 px patches: 4 tokens an image,
    the class token dropped), features from its last-but-one layer, conftest's tiny Llama."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from conftest import _config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = _config("llama", len(tokenizer))  # conftest's tiny Llama: llama3 rope scaling, tied embeddings
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


def load_hf_llava(path: str):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(path, backend="pil")


def picture(seed: int, size: tuple[int, int] = (40, 33)):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))


def hf_greedy(hf_llava, prompt: str, images: list, add_special_tokens: bool = True) -> tuple[list[int], list[float]]:
    """Greedy tokens by full forward passes over the prompt and the images, and their logprobs."""
    model, processor = hf_llava
    inputs = processor(text=prompt, images=images, add_special_tokens=add_special_tokens, return_tensors="pt")
    ids, tokens, logprobs = inputs["input_ids"], [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=ids, pixel_values=inputs["pixel_values"]).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs
