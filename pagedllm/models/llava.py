"""LLaVA (1.5): a CLIP vision tower, a two-layer projector into the language model's width, and a
language model of an existing family. Each image's patch features (from the tower's chosen layer,
the class token dropped) are its placeholder tokens' embeddings; positions and attention are the
language model's own, causal."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from pagedllm.config import PoolerConfig, text_config
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.models.interface import KVCache, MultiModalEmbeds, MultiModalLM
from pagedllm.models.registry import model_class
from pagedllm.models.vision import CLIPVisionTower, activation


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        vision, text = config.vision_config.hidden_size, text_config(config).hidden_size
        bias = getattr(config, "multimodal_projector_bias", True)
        self.linear_1, self.linear_2 = nn.Linear(vision, text, bias=bias), nn.Linear(text, text, bias=bias)
        self.act = activation(config.projector_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(MultiModalLM):
    supports_tensor_parallel = False
    default_pooler = PoolerConfig("LAST", normalize=True)

    def __init__(self, config, max_positions: int, quant_config=None) -> None:
        super().__init__()
        text = text_config(config)
        self.language_model = model_class(text)(text, max_positions, quant_config)
        layer = config.vision_feature_layer
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer {layer!r}: only one layer's features are supported")
        depth = config.vision_config.num_hidden_layers
        self.num_vision_layers = layer if layer >= 0 else depth + 1 + layer
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {config.vision_feature_select_strategy!r}")
        self.keep_class_token = config.vision_feature_select_strategy == "full"
        self.vision_tower = CLIPVisionTower(config.vision_config, self.num_vision_layers)
        self.multi_modal_projector = LlavaMultiModalProjector(config)

    def encode_image(self, data: dict[str, np.ndarray]) -> torch.Tensor:
        features = self.vision_tower(torch.from_numpy(data["pixel_values"]))
        return self.multi_modal_projector(features if self.keep_class_token else features[1:])

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
        self.language_model.load_weights(self._route(weights, vision))
        params = dict(self.named_parameters())
        missing = {n for n in params if not n.startswith("language_model.")} - set(vision)
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {sorted(missing)[:5]}")
        for name, tensor in vision.items():
            if name not in params or params[name].shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            params[name].data.copy_(tensor)

    def _route(self, weights: Iterable[tuple[str, torch.Tensor]], vision: dict[str, torch.Tensor]) -> Iterator:
        """The language model's tensors, renamed as a plain checkpoint of its family names them;
        the tower's and the projector's go into `vision` (the layers past the one used, and the
        unused final norm, dropped). Both the files' layout (language_model.model.*) and
        transformers' own (model.language_model.*) are read."""
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.")
            if name.startswith("language_model.model.") or name.startswith("language_model.lm_head."):
                yield name.removeprefix("language_model."), tensor
            elif name.startswith("language_model."):
                yield "model." + name.removeprefix("language_model."), tensor
            elif name == "lm_head.weight":
                yield name, tensor
            elif name.startswith("vision_tower.encoder.layers."):
                if int(name.split(".")[3]) < self.num_vision_layers:
                    vision[name] = tensor
            elif not name.startswith("vision_tower.post_layernorm."):
                vision[name] = tensor
