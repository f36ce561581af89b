"""What the engine asks of a model: models/loader.py builds, loads and binds it, the model runner
(worker/model_runner.py) runs it. Each family's class (models/llama.py, ...) is one of these,
found by its Hugging Face architecture name in models/registry.py."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
from torch import nn

from pagedllm.config import PoolerConfig
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.multimodal.inputs import MultiModalFeature

if TYPE_CHECKING:
    from pagedllm.models.gguf import GGUFFormat

KVCache = tuple[torch.Tensor, torch.Tensor]


class Model(nn.Module, ABC):
    """A model on a flat token batch. Its class is called as cls(hf_config, max_positions,
    quant_config) on the meta device, then materialized and loaded."""

    # False for an encoder (BERT): each prompt attends to all of itself, in one step, with no KV
    # cache; it embeds and does not generate.
    is_causal: ClassVar[bool] = True
    # How its hidden states pool into an embedding where the model folder does not say.
    default_pooler: ClassVar[PoolerConfig] = PoolerConfig("LAST", normalize=True)
    # What an encoder's pooled state serves ("embed"; a classification head's "classify", "score").
    pooling_tasks: ClassVar[tuple[str, ...]] = ("embed",)
    # How the family's GGUF files lay out their tensors and config (models/gguf.py's GGUFFormat;
    # None: the shared layout), for the file architecture models/registry.py names.
    gguf: ClassVar[GGUFFormat | None] = None

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in; every parameter must be filled exactly once."""

    @abstractmethod
    def bind_kernels(self) -> None:
        """After loading, once the linear layers' methods have processed their weights: hand work
        to fused kernels where they take it, saying in the log why not where they do not."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """[tokens] ids and positions -> [tokens, hidden], the final norm's output; writes each
        token's K/V into its layer's cache at attn_metadata.slot_mapping."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> fp32 [rows, vocab]."""


class CausalLM(Model):
    """A causal language model: it generates, and embeds by pooling its final hidden states."""


@dataclass
class MultiModalEmbeds:
    """A step's images' rows: `embeds[i]` replaces the embedding of the step's token `rows[i]`."""

    rows: torch.Tensor  # int64 [n]
    embeds: torch.Tensor  # [n, hidden]


class MultiModalLM(CausalLM):
    """A language model that also reads images: its encoder turns one image's processed inputs
    (a processor's arrays) into one embedding a placeholder token, which forward puts in place of
    those tokens' own."""

    @abstractmethod
    def encode_image(self, data: dict[str, np.ndarray]) -> torch.Tensor:
        """One image -> [placeholder tokens, hidden] in the model's dtype."""

    # Whether an image's tokens attend to each other both ways (Gemma 3): the runner marks each
    # image's rows (AttentionMetadata.image_spans), and no step may end inside an image.
    bidirectional_images: ClassVar[bool] = False
    # Whether its rotary positions are M-RoPE's three a token, which images give (rope_positions);
    # else a token's position is its index.
    mrope: ClassVar[bool] = False

    def rope_positions(self, features: Sequence[MultiModalFeature], num_prompt_tokens: int) -> RopePositions:
        """An M-RoPE model's positions of a prompt with these images."""
        raise NotImplementedError(f"{type(self).__name__} has no M-RoPE")


@dataclass(frozen=True)
class RopePositions:
    """M-RoPE positions of a prompt with images: [3, prompt tokens] (time, height, width); each
    token after the prompt, at index p, has p + delta in all three."""

    prompt: np.ndarray
    delta: int

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        mm: MultiModalEmbeds | None = None,
    ) -> torch.Tensor: ...
