"""Which model class serves which architecture. A family's module is imported only when a config
(or a GGUF file) asks for it; a new family is one file under models/ and one line here."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pagedllm.models.interface import Model


class Family(NamedTuple):
    module: str  # under pagedllm.models: its class of the architecture's name serves it
    model_type: str | None = None  # what a config without `architectures` names it by (a GGUF file's)
    gguf: str | None = None  # the GGUF files' general.architecture it reads (its class's `gguf` says how)


# Hugging Face architecture name -> its family.
_MODELS = {
    "LlamaForCausalLM": Family("llama", "llama", "llama"),
    "MistralForCausalLM": Family("mistral", "mistral", "mistral"),
    "Qwen2ForCausalLM": Family("qwen2", "qwen2", "qwen2"),
    "Qwen3ForCausalLM": Family("qwen3", "qwen3", "qwen3"),
    "Gemma3ForCausalLM": Family("gemma3", "gemma3_text", "gemma3"),
    "Gemma2ForCausalLM": Family("gemma3", "gemma2", "gemma2"),
    "Phi3ForCausalLM": Family("phi3", "phi3", "phi3"),
    "Qwen2MoeForCausalLM": Family("qwen2_moe", "qwen2_moe", "qwen2moe"),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", "qwen3_moe", "qwen3moe"),
    "GraniteForCausalLM": Family("granite", "granite", "granite"),
    "GraniteMoeForCausalLM": Family("granite_moe", "granitemoe", "granitemoe"),
    "GptOssForCausalLM": Family("gpt_oss", "gpt_oss", "gpt-oss"),
    "Olmo2ForCausalLM": Family("olmo2", "olmo2", "olmo2"),
    "SmolLM3ForCausalLM": Family("smollm3", "smollm3", "smollm3"),
    "DeepseekV2ForCausalLM": Family("deepseek_v2", "deepseek_v2", "deepseek2"),
    "MixtralForCausalLM": Family("mixtral", "mixtral"),  # (llama.cpp writes Mixtral as "llama" with experts)
    "LlavaForConditionalGeneration": Family("llava", "llava"),
    "Qwen2VLForConditionalGeneration": Family("qwen2_vl", "qwen2_vl", "qwen2vl"),  # (a text file: Qwen2's)
    "Gemma3ForConditionalGeneration": Family("gemma3_mm", "gemma3"),
    "BertModel": Family("bert"),
    "BertForSequenceClassification": Family("bert"),
}


def model_class(config) -> type[Model]:
    names = list(getattr(config, "architectures", None) or [])
    if not names:
        names = [name for name, family in _MODELS.items() if family.model_type == getattr(config, "model_type", None)]
    for name in names:
        if name in _MODELS:
            return _load(name)
    raise ValueError(
        f"unsupported model architecture {names or config.model_type!r}; supported: {', '.join(sorted(_MODELS))}"
    )


def gguf_family(arch: str) -> type[Model] | None:
    """The class whose family reads GGUF files of this general.architecture (None: no family does)."""
    return next((_load(name) for name, family in _MODELS.items() if family.gguf == arch), None)


def gguf_architectures() -> set[str]:
    return {family.gguf for family in _MODELS.values() if family.gguf is not None}


def _load(name: str) -> type[Model]:
    return getattr(importlib.import_module(f"pagedllm.models.{_MODELS[name].module}"), name)
