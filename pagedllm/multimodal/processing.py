"""Prompts with images, made ready for the engine as the model's transformers processor makes
them: its image processor (on the Pillow backend) makes the encoder's inputs, each image's
placeholder is expanded into the tokens its embeddings take, and the text is tokenized. Each
image becomes a MultiModalFeature."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedllm.multimodal.inputs import MultiModalFeature, content_identifier

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ImagePrompt:
    """A text prompt with images: each image's placeholder (the model's own, e.g. `<image>`) sits
    in the text where the image goes, as in vLLM's {"prompt", "multi_modal_data": {"image"}}."""

    prompt: str
    images: tuple[Any, ...]  # PIL images
    # False where a chat template already wrote the special tokens (as transformers' processors
    # tokenize a rendered chat).
    add_special_tokens: bool = True


def tokens_per_image(hf_config, path: str, mmproj: str | None = None) -> int:
    """The most placeholder tokens one image of this model takes (its processor's largest image,
    for a model of dynamic resolution); 0 for a model without images."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type == "llava":
        vision = hf_config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        return patches + (1 if hf_config.vision_feature_select_strategy == "full" else 0)
    if model_type == "gemma3":
        return hf_config.mm_tokens_per_image
    if model_type == "qwen2_vl":
        images = load_image_processor(path, mmproj)
        return images.size["longest_edge"] // (images.patch_size * images.merge_size) ** 2
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
    """One per engine; callable from any thread. The image processor is transformers' (its Pillow
    backend, under a lock); each image's placeholder is expanded into its tokens as the family's
    transformers processor does, and the text tokenized by the engine's tokenizer. (Not the
    processor class itself: Qwen2-VL's needs a video processor, which needs torchvision.)"""

    def __init__(
        self, path: str, hf_config, tokenizer: Callable[[], PreTrainedTokenizerBase], mmproj: str | None = None
    ) -> None:
        self.image_processor = load_image_processor(path, mmproj)
        self.tokenizer = tokenizer
        self.model_type = hf_config.model_type
        if getattr(self.image_processor, "do_pan_and_scan", False):
            raise ValueError("the image processor's do_pan_and_scan (Gemma 3's crops) is not supported")
        self.image_token_id = int(getattr(hf_config, "image_token_index", None) or hf_config.image_token_id)
        self.image_token = tokenizer().convert_ids_to_tokens(self.image_token_id)
        # What stands for an image in a prompt, and the text it becomes for an image of n tokens.
        self.placeholder, self._around = self.image_token, ("", "")
        if self.model_type == "gemma3":  # <start_of_image> becomes its soft tokens, wrapped
            self.placeholder = tokenizer().convert_ids_to_tokens(hf_config.boi_token_index)
            end = tokenizer().convert_ids_to_tokens(hf_config.eoi_token_index)
            self._around = (f"\n\n{self.placeholder}", f"{end}\n\n")
        self.tokens_per_image = tokens_per_image(hf_config, path, mmproj)
        self._lock = threading.Lock()

    def __call__(self, prompt: ImagePrompt) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """The prompt's token ids (placeholders expanded) and its images' features, in order."""
        images = self._images(prompt.images)
        lengths = [self._num_tokens(data) for data in images]
        token_ids = self._expand_and_tokenize(prompt, lengths)
        offsets = self._placeholder_offsets(token_ids, lengths)
        features = tuple(
            MultiModalFeature("image", _identifier(self.model_type, data), offset, length, data)
            for offset, length, data in zip(offsets, lengths, images, strict=True)
        )
        return token_ids, features

    def _images(self, images: Sequence[Any]) -> list[dict[str, np.ndarray]]:
        """Each image's encoder inputs (its pixel values, and its patch grid where the size varies)."""
        if not images:
            return []
        try:
            with self._lock:
                out = self.image_processor(list(images), return_tensors="np")
        except (ValueError, TypeError, OSError, OverflowError, MemoryError, IndexError) as exc:
            raise ValueError(f"cannot process the prompt's images: {exc}") from exc
        pixels = out["pixel_values"]
        if "image_grid_thw" not in out:
            return [{"pixel_values": np.ascontiguousarray(p)} for p in pixels]
        grids = out["image_grid_thw"]
        ends = np.cumsum(grids.prod(axis=1))  # the images' patches, one after another
        return [
            {"pixel_values": np.ascontiguousarray(pixels[end - grid.prod() : end]), "image_grid_thw": grid}
            for end, grid in zip(ends, grids, strict=True)
        ]

    def _num_tokens(self, data: dict[str, np.ndarray]) -> int:
        if "image_grid_thw" in data:
            return int(data["image_grid_thw"].prod()) // self.image_processor.merge_size**2
        return self.tokens_per_image

    def _expand_and_tokenize(self, prompt: ImagePrompt, lengths: list[int]) -> list[int]:
        pieces = prompt.prompt.split(self.placeholder)
        if len(pieces) - 1 != len(lengths):
            raise ValueError(
                f"the prompt has {len(pieces) - 1} image placeholders ({self.placeholder}) for {len(lengths)} image(s)"
            )
        before, after = self._around
        text = pieces[0] + "".join(
            before + self.image_token * n + after + piece for n, piece in zip(lengths, pieces[1:])
        )
        return list(self.tokenizer()(text, add_special_tokens=prompt.add_special_tokens)["input_ids"])

    def _placeholder_offsets(self, token_ids: Sequence[int], lengths: list[int]) -> list[int]:
        """Where each image's run of placeholder tokens starts (runs of adjacent images abut)."""
        positions = np.flatnonzero(np.asarray(token_ids) == self.image_token_id)
        if len(positions) != sum(lengths):
            raise ValueError(f"the prompt tokenizes to {len(positions)} image placeholder tokens, not {sum(lengths)}")
        starts = np.cumsum([0, *lengths[:-1]], dtype=np.int64)
        for start, n in zip(starts, lengths):
            if positions[start + n - 1] - positions[start] != n - 1:
                raise ValueError("an image's placeholder tokens are not all together in the prompt")
        return [int(positions[start]) for start in starts]


def load_image_processor(path: str, mmproj: str | None = None):
    """The model's image processor (transformers', on Pillow): its folder's, or for a GGUF model
    the family's with its projector file's settings."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path, backend="pil") if mmproj is None else _mmproj_images(mmproj)


def _mmproj_images(mmproj: str):
    """The family's image processor with a projector file's mean and deviation (and Gemma 3's image
    size; Qwen2-VL's resolution limits are its processor's defaults: the file has none)."""
    import gguf
    from transformers import Gemma3ImageProcessorPil, Qwen2VLImageProcessorPil

    fields = gguf.GGUFReader(mmproj).fields

    def value(key: str):
        field = fields.get(key)
        if field is None:
            raise ValueError(f"{mmproj}: the projector file lacks {key}")
        return field.contents()

    normalize = {"image_mean": list(value("clip.vision.image_mean")), "image_std": list(value("clip.vision.image_std"))}
    if value("clip.projector_type") == "qwen2vl_merger":
        return Qwen2VLImageProcessorPil(patch_size=int(value("clip.vision.patch_size")), **normalize)
    size = int(value("clip.vision.image_size"))
    return Gemma3ImageProcessorPil(size={"height": size, "width": size}, **normalize)


def _identifier(model_type: str, data: dict[str, np.ndarray]) -> int:
    """The content hash of what the encoder is fed: every array, its name and shape included."""
    parts = [model_type.encode()]
    for name in sorted(data):
        array = np.ascontiguousarray(data[name])
        parts += [name.encode(), str(array.dtype).encode(), str(array.shape).encode(), array.tobytes()]
    return content_identifier(*parts)
