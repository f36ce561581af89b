"""Tiny vision-language models (conftest's llava_dir, qwen2_vl_dir and gemma3_vl_dir write them once a session)
and transformers' greedy tokens on them."""

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


QWEN2_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def make_qwen2_vl(path, tokenizer_dir: str) -> str:
    """Qwen2-VL's shape in small: a 2-block vision transformer (14 px patches, 2x2 merged: 56x56 to
    112x112 pixels, 4 to 16 tokens an image), a 2-layer Qwen2 with M-RoPE sections [2, 3, 3]."""
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    specials = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    start, image, end, video = tokenizer.convert_tokens_to_ids(specials)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.2,
    )
    # Three blocks: llama.cpp's converter maps the merger's "mlp.2" as a block index.
    vision = dict(depth=3, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, initializer_range=0.2)
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    with torch.no_grad():
        set_vision_weights(model)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


GEMMA3_IMAGE = "<start_of_image>"


def make_gemma3_vl(path, tokenizer_dir: str, **text_overrides) -> str:
    """Gemma 3's shape in small: a 2-layer SigLIP tower (56 px, 14 px patches pooled 2x2: 4 tokens
    an image), test_gemma3's 4-layer text model (windows of 8 beside a full layer). The tower's and
    the projector's weights come from a generator of their own, whatever the text model is, so
    that tests/data's mmproj file (made from them by llama.cpp's converter) holds them."""
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
    )

    specials = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, extra_special_tokens=specials)
    boi, eoi, image = tokenizer.convert_tokens_to_ids(list(specials.values()))
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "max_position_embeddings": 512,
        "sliding_window": 8,  # smaller than the prompts, and than an image's reach
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "initializer_range": 0.2,
        **text_overrides,
    }
    vision = dict(
        vision_use_head=False,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=56,
        patch_size=14,
        initializer_range=0.2,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=image,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # HF starts Gemma's norm weights at 0 (a scale of 1): make them matter
        for name, param in model.named_parameters():
            if "norm" in name and "vision_tower" not in name:
                param.normal_(0.0, 0.3)
        set_vision_weights(model)
    model.save_pretrained(path)
    images = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    Gemma3Processor(images, tokenizer, image_seq_length=4).save_pretrained(path)
    return str(path)


def set_vision_weights(model) -> None:
    """The tower's and the projector's weights from their own seeded generator, in name order:
    LayerNorm weights near 1 (Gemma's norm near 0, an offset from 1), the rest N(0, 0.2). Gemma's
    projection is rounded to float16, as llama.cpp's converter keeps it."""
    generator = torch.Generator().manual_seed(46)
    layer_norm_weights = {
        f"{name}.weight" for name, module in model.named_modules() if isinstance(module, torch.nn.LayerNorm)
    }
    for name, param in sorted(model.named_parameters()):
        if "language_model" in name or name == "lm_head.weight":
            continue
        noise = torch.randn(param.shape, generator=generator) * (0.1 if "norm" in name or "ln_" in name else 0.2)
        param.copy_(noise + 1 if name in layer_norm_weights else noise)
        if "mm_input_projection" in name:
            param.copy_(param.half().float())


def load_hf_gemma3(path: str):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(path, backend="pil")


def load_hf_llava(path: str):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(path, backend="pil")


def load_hf_qwen2_vl(path: str):
    """transformers' model and processor. Its processor class checks that it has a video processor,
    which needs torchvision: this one skips that check (it is given none, and no videos)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    class ImagesOnly(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None

    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    images = AutoImageProcessor.from_pretrained(path, backend="pil")
    return model, ImagesOnly(images, AutoTokenizer.from_pretrained(path), None)


def picture(seed: int, size: tuple[int, int] = (40, 33)):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))


def hf_greedy(hf_vlm, prompt: str, images: list, add_special_tokens: bool = True) -> tuple[list[int], list[float]]:
    """Greedy tokens by full forward passes over the prompt and the images, and their logprobs."""
    model, processor = hf_vlm
    inputs = dict(
        processor(text=prompt, images=images or None, add_special_tokens=add_special_tokens, return_tensors="pt")
    )
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(**inputs, use_cache=False).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            # The next pass's inputs: the token appended (a text token: attended, of type 0).
            for name, column in (
                ("input_ids", token),
                ("attention_mask", 1),
                ("mm_token_type_ids", 0),
                ("token_type_ids", 0),
            ):
                if name in inputs:
                    inputs[name] = torch.cat([inputs[name], torch.tensor([[column]])], dim=1)
    return tokens, logprobs
