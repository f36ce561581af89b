"""LLaVA (1.5): a CLIP vision tower, a two-layer projector into the language model's width, and a
language model of an existing family. Each image's patch features (from the tower's chosen layer,
the class token dropped) are its placeholder tokens' embeddings; positions and attention are the
language model's own, causal."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.config import text_config
from pagedllm.models.registry import model_class
from pagedllm.models.vision import CLIPVisionTower, activation
from pagedllm.models.vlm import VisionLanguageModel, language_model_tensor


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        vision, text = config.vision_config.hidden_size, text_config(config).hidden_size
        bias = getattr(config, "multimodal_projector_bias", True)
        self.linear_1, self.linear_2 = nn.Linear(vision, text, bias=bias), nn.Linear(text, text, bias=bias)
        self.act = activation(config.projector_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel):
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

    def route(self, name: str) -> tuple[str, str] | None:
        """Both the files' layout (language_model.model.*) and transformers' own
        (model.language_model.*) are read; the tower's layers past the one used, and its unused
        final norm, are dropped."""
        text = language_model_tensor(name)
        if text is not None:
            return "text", text
        name = name.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.")
        if name.startswith("vision_tower.encoder.layers.") and int(name.split(".")[3]) >= self.num_vision_layers:
            return None
        return None if name.startswith("vision_tower.post_layernorm.") else ("vision", name)
