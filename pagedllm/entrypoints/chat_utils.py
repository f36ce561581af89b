"""Conversations to prompt token ids with the model's chat template."""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def apply_chat_template(
    tokenizer,
    messages: list[Message],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Prompt token ids of a conversation under the model's (or the given) chat template. `tools`
    (OpenAI's tool definitions) go to the template as transformers hands them over, in the shape
    the templates of tool-calling models expect; `template_kwargs` are the template's own variables
    (Qwen3's enable_thinking)."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model has no chat template; pass chat_template=...")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"a chat message is a dict with 'role' and 'content', got {message!r}")
    ids = tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=True,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        **(template_kwargs or {}),
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
