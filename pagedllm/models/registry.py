"""Which model class serves which Hugging Face architecture name."""
from __future__ import annotations

from torch import nn

from pagedllm.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def model_class(config) -> type[nn.Module]:
    names = list(getattr(config, "architectures", None) or [])
    if not names and getattr(config, "model_type", None) in _MODEL_TYPES:
        names = [_MODEL_TYPES[config.model_type]]
    for name in names:
        if name in _MODELS:
            return _MODELS[name]
    raise ValueError(f"unsupported model architecture {names or config.model_type!r}; "
                     f"supported: {', '.join(sorted(_MODELS))}")
