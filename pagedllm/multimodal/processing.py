"""Prompts with images, made ready for the engine by the model's own processor (transformers',
on its Pillow backend): it expands each image's placeholder into the tokens its embeddings take,
tokenizes, and makes the encoder's inputs. Each image becomes a MultiModalFeature."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.multimodal.inputs import MultiModalFeature, content_identifier


@dataclass(frozen=True)
class ImagePrompt:
    """A text prompt with images: each image's placeholder (the model's own, e.g. `<image>`) sits
    in the text where the image goes, as in vLLM's {"prompt", "multi_modal_data": {"image"}}."""

    prompt: str
    images: tuple[Any, ...]  # PIL images
    # False where a chat template already wrote the special tokens (as transformers' processors
    # tokenize a rendered chat).
    add_special_tokens: bool = True


def tokens_per_image(hf_config) -> int:
    """The most placeholder tokens one image of this model takes; 0 for a model without images."""
    if getattr(hf_config, "model_type", None) == "llava":
        vision = hf_config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        return patches + (1 if hf_config.vision_feature_select_strategy == "full" else 0)
    return 0


def image_prompt(prompt: dict) -> ImagePrompt:
    """vLLM's prompt dict with multi_modal_data, checked: {"image": an image or a list of them}."""
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(
            f"multi_modal_data takes only 'image', got {sorted(data) if isinstance(data, dict) else data!r}"
        )
    if "prompt" not in prompt or not isinstance(prompt["prompt"], str):
        raise ValueError("a prompt with multi_modal_data needs its text in 'prompt'")
    images = data.get("image", [])
    images = tuple(images) if isinstance(images, (list, tuple)) else (images,)
    from PIL import Image

    for image in images:
        if not isinstance(image, Image.Image):
            raise ValueError(f"multi_modal_data['image'] takes PIL images, got {type(image).__name__}")
    return ImagePrompt(prompt["prompt"], images)


class ImageProcessor:
    """One per engine; callable from any thread (the processor is called under a lock)."""

    def __init__(self, path: str, hf_config) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path, backend="pil")
        self.image_token_id = int(getattr(hf_config, "image_token_index", None) or hf_config.image_token_id)
        self.tokens_per_image = tokens_per_image(hf_config)
        self.model_type = hf_config.model_type
        self._lock = threading.Lock()

    def __call__(self, prompt: ImagePrompt) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """The prompt's token ids (placeholders expanded) and its images' features, in order."""
        try:
            with self._lock:
                out = self.processor(
                    text=prompt.prompt,
                    images=list(prompt.images) or None,
                    add_special_tokens=prompt.add_special_tokens,
                    return_tensors="np",
                )
        except (ValueError, TypeError, OSError, OverflowError, MemoryError, IndexError) as exc:
            raise ValueError(f"cannot process the prompt's images: {exc}") from exc
        token_ids = [int(t) for t in out["input_ids"][0]]
        pixels = out.get("pixel_values")
        offsets = self._placeholder_offsets(token_ids, len(prompt.images))
        features = tuple(
            MultiModalFeature(
                "image",
                content_identifier(self.model_type.encode(), str(p.shape).encode(), np.ascontiguousarray(p).tobytes()),
                offset,
                self.tokens_per_image,
                {"pixel_values": np.ascontiguousarray(p)},
            )
            for offset, p in zip(offsets, pixels if pixels is not None else (), strict=True)
        )
        return token_ids, features

    def _placeholder_offsets(self, token_ids: Sequence[int], num_images: int) -> list[int]:
        """Where each image's run of placeholder tokens starts (runs of adjacent images abut)."""
        ids = np.asarray(token_ids)
        positions = np.flatnonzero(ids == self.image_token_id)
        if len(positions) != num_images * self.tokens_per_image:
            raise ValueError(
                f"the prompt has {len(positions)} image placeholder tokens for {num_images} image(s) "
                f"of {self.tokens_per_image} each"
            )
        runs = positions.reshape(num_images, self.tokens_per_image)
        if (runs[:, -1] - runs[:, 0] != self.tokens_per_image - 1).any():
            raise ValueError("an image's placeholder tokens are not all together in the prompt")
        return [int(start) for start in runs[:, 0]]
