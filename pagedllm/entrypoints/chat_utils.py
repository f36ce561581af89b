"""Conversations to prompt token ids with the model's chat template; a conversation with images
to an ImagePrompt (its rendered text and its images, in order), which the model's processor
tokenizes."""

from __future__ import annotations

from typing import Any

from pagedllm.multimodal.media import load_image_url
from pagedllm.multimodal.processing import ImagePrompt

Message = dict[str, Any]


def apply_chat_template(
    tokenizer,
    messages: list[Message],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    allowed_local_media_path: str | None = None,
    takes_images: bool = True,
    max_images: int | None = None,
) -> list[int] | ImagePrompt:
    """Prompt token ids of a conversation under the model's (or the given) chat template. `tools`
    (OpenAI's tool definitions) go to the template as transformers hands them over, in the shape
    the templates of tool-calling models expect; `template_kwargs` are the template's own variables
    (Qwen3's enable_thinking). Image parts (OpenAI's image_url, or vLLM's image_pil) reach the
    template as {"type": "image"}, as vision-language models' templates take them (`takes_images`
    False: the model reads none, and an image part is refused before anything is loaded; nor is
    anything loaded for more images than `max_images`, --limit-mm-per-prompt's)."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model has no chat template; pass chat_template=...")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"a chat message is a dict with 'role' and 'content', got {message!r}")
    num_images = sum(_num_images(m) for m in messages)
    if num_images and not takes_images:
        raise ValueError("this model takes no images: its messages' content may hold text parts only")
    if max_images is not None and num_images > max_images:
        raise ValueError(f"the messages hold {num_images} images; --limit-mm-per-prompt allows {max_images}")
    images: list = []
    messages = [_with_image_slots(m, images, allowed_local_media_path) for m in messages]
    rendered = tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=not images,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        **(template_kwargs or {}),
    )
    if images:
        return ImagePrompt(str(rendered), tuple(images), add_special_tokens=False)  # the template wrote them
    if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):
        rendered = rendered["input_ids"]
    return list(rendered)


def _num_images(message: Message) -> int:
    content = message.get("content")
    if not isinstance(content, list):
        return 0
    return sum(isinstance(p, dict) and p.get("type") in ("image_url", "image_pil") for p in content)


def _with_image_slots(message: Message, images: list, allowed_local_media_path: str | None) -> Message:
    """The message as the template takes it: text parts' text, image parts as {"type": "image"}
    (their images loaded into `images`); content of text parts alone joined into a string."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            images.append(load_image_url(url, allowed_local_media_path))
            parts.append({"type": "image"})
        elif kind == "image_pil":
            from PIL import Image

            if not isinstance(part.get("image_pil"), Image.Image):
                raise ValueError("an image_pil part holds a PIL image")
            images.append(part["image_pil"].convert("RGB"))
            parts.append({"type": "image"})
        else:
            raise ValueError(f"unsupported content part type {kind!r}: text, image_url and image_pil are taken")
    if all(p["type"] == "text" for p in parts):
        return {**message, "content": "".join(p["text"] for p in parts)}
    return {**message, "content": parts}
