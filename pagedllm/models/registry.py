"""Which model class serves which Hugging Face architecture name. A family's module is imported
only when a config asks for it; a new family is one file under models/ and one line here."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.models.interface import Model

# Architecture name -> the module under pagedllm.models whose class of that name serves it.
_MODELS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma2ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "BertModel": "bert",
}
# For configs that name no architecture (a GGUF file's: models/gguf.py sets its model_type).
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def model_class(config) -> type[Model]:
    names = list(getattr(config, "architectures", None) or [])
    if not names and getattr(config, "model_type", None) in _MODEL_TYPES:
        names = [_MODEL_TYPES[config.model_type]]
    for name in names:
        if name in _MODELS:
            return getattr(importlib.import_module(f"pagedllm.models.{_MODELS[name]}"), name)
    raise ValueError(
        f"unsupported model architecture {names or config.model_type!r}; supported: {', '.join(sorted(_MODELS))}"
    )
