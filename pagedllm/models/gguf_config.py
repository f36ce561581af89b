"""The config of a GGUF model: transformers' base config holding the file's fields, with the defaults
of the per-model config classes for the fields our layers read.

Not transformers' LlamaConfig, Qwen2Config...: in transformers 5 importing any of them pulls in its
model-loading code and torch.distributed.tensor (and sympy with it), 56 MiB of resident memory and a
second of start-up for a served GGUF model, whose allowance beside its weights and KV cache is 400 MB.
"""

from __future__ import annotations

from dataclasses import dataclass

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

# Defaults of transformers' config class for a model type, where they differ from the ones below.
MODEL_TYPE_DEFAULTS: dict[str, dict] = {"mistral": {"sliding_window": 4096}}
# Types whose configs window attention only where `use_sliding_window` says so, which GGUF files
# cannot carry: transformers reads such a file with full attention on every layer, as llama.cpp runs it.
FULL_ATTENTION_TYPES = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})


@strict(accept_kwargs=True)
@dataclass(repr=False)
class GGUFModelConfig(PreTrainedConfig):
    """Fields not declared here (hidden_size, vocab_size, ...) are kept as given, as attributes."""

    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None  # declared, so the base class folds rope_theta into it
    sliding_window: int | None = None
    head_dim: int | None = None
    num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.model_type in FULL_ATTENTION_TYPES:
            self.sliding_window = None


def gguf_config(values: dict) -> GGUFModelConfig:
    """The config of the fields `values` (transformers' GGUF renames applied, model_type among them)."""
    return GGUFModelConfig(**{**MODEL_TYPE_DEFAULTS.get(values["model_type"], {}), **values})
