"""What the vision-language families share: a language model of an existing family whose
placeholder tokens take their embeddings from the image encoder, and loading that sends each
checkpoint tensor to the language model or to the vision side under the family's own routing."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Iterator

import torch

from pagedllm.config import PoolerConfig
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.models.decoder import DecoderForCausalLM
from pagedllm.models.interface import KVCache, MultiModalEmbeds, MultiModalLM


def language_model_tensor(name: str) -> str | None:
    """A tensor's name in a plain checkpoint of the language model's family, from the layout of
    LLaVA's and Gemma 3's files (language_model.model.*, language_model.lm_head.*) or transformers'
    own (model.language_model.*, lm_head.*); None: not the language model's."""
    name = name.removeprefix("model.")
    if name.startswith("language_model.model.") or name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model."):
        return "model." + name.removeprefix("language_model.")
    return name if name == "lm_head.weight" else None


class VisionLanguageModel(MultiModalLM):
    supports_tensor_parallel = False
    default_pooler = PoolerConfig("LAST", normalize=True)
    language_model: DecoderForCausalLM

    @abstractmethod
    def route(self, name: str) -> tuple[str, str] | None:
        """A checkpoint tensor's place: ("text", its name in a plain checkpoint of the language
        model's family) or ("vision", our parameter's name); None: a tensor the model never uses."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        mm: MultiModalEmbeds | None = None,
    ) -> torch.Tensor:
        x = self.language_model.embed(input_ids)
        if mm is not None:
            x[mm.rows] = mm.embeds.to(x.dtype)
        return self.language_model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds=x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def bind_kernels(self) -> None:
        self.language_model.bind_kernels()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision: dict[str, torch.Tensor] = {}
        self.language_model.load_weights(self._split(weights, vision))
        params = dict(self.named_parameters())
        missing = {n for n in params if not n.startswith("language_model.")} - set(vision)
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {sorted(missing)[:5]}")
        for name, tensor in vision.items():
            if name not in params or params[name].shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            params[name].data.copy_(tensor)

    def _split(self, weights: Iterable[tuple[str, torch.Tensor]], vision: dict[str, torch.Tensor]) -> Iterator:
        for name, tensor in weights:
            place = self.route(name)
            if place is None:
                continue
            if place[0] == "text":
                yield place[1], tensor
            else:
                vision[place[1]] = tensor
