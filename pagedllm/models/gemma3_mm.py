"""Gemma 3 with images: a SigLIP vision tower (its final norm used, its pooling head not), each
image's patch grid average-pooled to mm_tokens_per_image tokens, Gemma-normed and projected into
the language model's width, in place of the image's soft tokens (after the text embeddings'
sqrt(hidden) scale, which they do not take). An image's tokens attend to each other both ways:
the attention layers overlay that on the causal mask (layers/attention.py's image_attention), and
the scheduler never lets a step, or a prefix hit, end inside an image."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import text_config
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.vision import VisionEncoder
from pagedllm.models.vlm import VisionLanguageModel, language_model_tensor


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, patch, stride=patch)
        self.position_embedding = nn.Embedding((config.image_size // patch) ** 2, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[3, H, W] -> [patches, hidden], the patches row by row."""
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixels[None].to(weight.device, weight.dtype)).flatten(2)[0].T
        return patches + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = VisionEncoder(config, config.num_hidden_layers)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        vision = config.vision_config
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, text_config(config).hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.side = vision.image_size // vision.patch_size
        self.kernel = self.side // int(config.mm_tokens_per_image**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = x.T.reshape(1, -1, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2)[0].T
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    bidirectional_images = True

    def __init__(self, config, max_positions: int, quant_config=None) -> None:
        super().__init__()
        self.language_model = Gemma3ForCausalLM(text_config(config), max_positions, quant_config)
        self.vision_tower = SiglipVisionTower(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    def encode_image(self, data: dict[str, np.ndarray]) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(torch.from_numpy(data["pixel_values"])))

    def route(self, name: str) -> tuple[str, str] | None:
        """The files' layout (language_model.model.*, vision_tower.vision_model.*) and transformers'
        own (model.language_model.*, model.vision_tower.*); SigLIP's pooling head is never used."""
        text = language_model_tensor(name)
        if text is not None:
            return "text", text
        name = name.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.")
        return None if name.startswith("vision_tower.head.") else ("vision", name)
