"""Qwen2-VL: images at their own resolution (a grid of 14 px patches, so each image has its own
number of tokens), a vision transformer with 2-D rotary positions over the patches, a merger that
folds each 2x2 block of patches into one token of the language model's width, and a Qwen2 language
model whose rotary positions are three (M-RoPE): an image's tokens take (time, row, column) of
their block, the text after it goes on from the largest of those."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import text_config
from pagedllm.layers.rotary import RopeTables, apply_rotary
from pagedllm.models.gguf import GGUFFormat, field_value
from pagedllm.models.interface import RopePositions
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.vision import VisionMLP
from pagedllm.models.vlm import VisionLanguageModel, language_model_tensor
from pagedllm.multimodal.inputs import MultiModalFeature


class Qwen2VLPatchEmbed(nn.Module):
    """A Conv3d whose kernel is its stride and exactly one patch: a matmul over the processor's
    flattened patches, whose (channel, time, row, column) order is the kernel's."""

    def __init__(self, config) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.embed_dim, kernel, stride=kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return patches.to(weight.device, weight.dtype) @ weight.flatten(1).T


class Qwen2VLVisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        tokens, dim = x.shape
        q, k, v = self.qkv(x).view(tokens, 3, self.heads, -1).unbind(1)
        # Rotated in fp32, as transformers does, then back to the model's dtype.
        q, k = (apply_rotary(t.float(), rope).to(x.dtype) for t in (q, k))
        # [1, heads, tokens, head_dim]: with a batch dimension, PyTorch's fused CPU attention takes it
        # (3-D inputs go to its unfused path, several times slower).
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0]
        return self.proj(out.transpose(0, 1).reshape(tokens, dim))


class Qwen2VLVisionBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        dim = config.embed_dim
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = Qwen2VLVisionAttention(dim, config.num_heads)
        self.mlp = VisionMLP(dim, int(dim * config.mlp_ratio), config.hidden_act)

    def forward(self, x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class Qwen2VLPatchMerger(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.width = config.embed_dim * config.spatial_merge_size**2
        self.ln_q = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, config.hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_embed = Qwen2VLPatchEmbed(config)
        self.blocks = nn.ModuleList(Qwen2VLVisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen2VLPatchMerger(config)
        self.head_dim = config.embed_dim // config.num_heads
        self.theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)

    def forward(self, patches: torch.Tensor, grid_thw: Sequence[int]) -> torch.Tensor:
        """One image's processed patches, [t * h * w, C * T * P * P] in the processor's order (each
        2x2 block's patches together) -> [t * h * w / 4, language width]."""
        x = self.patch_embed(patches)
        rope = self._rope(grid_thw, x.device)
        for block in self.blocks:
            x = block(x, rope)
        return self.merger(x)

    def _rope(self, grid_thw: Sequence[int], device: torch.device) -> RopeTables:
        t, h, w = (int(n) for n in grid_thw)
        m, half = self.merge, self.head_dim // 2
        # Half of a head's pairs turn with the patch's row, half with its column.
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
        angles = torch.cat([torch.outer(rows.float(), inv_freq), torch.outer(cols.float(), inv_freq)], -1)
        angles = torch.cat([angles, angles], -1).repeat(t, 1).to(device)
        return RopeTables(angles.cos(), angles.sin())


def qwen2vl_gguf_config(reader, values: dict):
    """A text file of llama.cpp's qwen2vl architecture: Qwen2's config with its M-RoPE sections
    (the file's rope.dimension_sections), for the language model alone (Qwen2ForCausalLM); its
    projector file (--mmproj) makes the vision-language model of it."""
    from pagedllm.models.gguf_config import gguf_config

    sections = [int(n) for n in field_value(reader, "qwen2vl.rope.dimension_sections") or []][:3]
    if not sections:
        raise ValueError("a qwen2vl GGUF file needs qwen2vl.rope.dimension_sections (M-RoPE)")
    rope = {"rope_type": "default", "rope_theta": float(values.pop("rope_theta", 1000000.0)), "mrope_section": sections}
    return gguf_config({**values, "rope_parameters": rope, "architectures": ["Qwen2ForCausalLM"]})


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    mrope = True
    gguf = GGUFFormat(transformers_key="qwen2", config=qwen2vl_gguf_config)

    def __init__(self, config, max_positions: int, quant_config=None) -> None:
        super().__init__()
        self.language_model = Qwen2ForCausalLM(text_config(config), max_positions, quant_config)
        self.visual = Qwen2VisionTransformer(config.vision_config)
        self.merge = config.vision_config.spatial_merge_size

    def encode_image(self, data: dict[str, np.ndarray]) -> torch.Tensor:
        return self.visual(torch.from_numpy(data["pixel_values"]), data["image_grid_thw"].tolist())

    def rope_positions(self, features: Sequence[MultiModalFeature], num_prompt_tokens: int) -> RopePositions:
        """Text tokens count on by one from where the last image left off; an image's tokens take
        its first position plus (time, row, column) of their block; the next text starts one past
        the image's largest position."""
        positions = np.empty((3, num_prompt_tokens), dtype=np.int64)
        index = next_position = 0
        for feature in sorted(features, key=lambda f: f.offset):
            text = feature.offset - index
            positions[:, index : feature.offset] = next_position + np.arange(text)
            next_position += text
            t, h, w = (int(n) for n in feature.data["image_grid_thw"])
            h, w = h // self.merge, w // self.merge
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
            positions[:, feature.offset : feature.end] = next_position + grid
            next_position += max(h, w)
            index = feature.end
        positions[:, index:] = next_position + np.arange(num_prompt_tokens - index)
        return RopePositions(positions, int(positions.max()) + 1 - num_prompt_tokens)

    def route(self, name: str) -> tuple[str, str] | None:
        """The original files' layout (model.*, visual.*), transformers' (model.language_model.*,
        model.visual.*), and a GGUF text file's beside a projector file (language_model.*)."""
        text = language_model_tensor(name)
        if text is not None:
            return "text", text
        if name.startswith("visual.") or name.startswith("model.visual."):
            return "vision", name.removeprefix("model.")
        return "text", name
