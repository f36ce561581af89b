"""Vision encoders: plain pre-norm transformers over an image's patches, in the model's dtype. An
image attends to all of itself, alone (one image a call), so each image's output is the same
whatever else is encoded: the encoder cache keeps outputs per image."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} in a vision model; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        # [1, heads, tokens, head_dim]: with a batch dimension, PyTorch's fused CPU attention takes it
        # (3-D inputs go to its unfused path, several times slower). Not causal: each patch sees all.
        q, k, v = (
            p(x).view(tokens, self.heads, -1).transpose(0, 1)[None] for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)[0]
        return self.out_proj(out.transpose(0, 1).reshape(tokens, hidden))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(hidden, eps=eps), nn.LayerNorm(hidden, eps=eps)
        self.self_attn = VisionAttention(hidden, config.num_attention_heads)
        self.mlp = VisionMLP(hidden, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(num_layers))


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, patch, stride=patch, bias=False)
        self.position_embedding = nn.Embedding((config.image_size // patch) ** 2 + 1, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[3, H, W] -> [1 + patches, hidden]: the class token, then the patches row by row."""
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixels[None].to(weight.device, weight.dtype)).flatten(2)[0].T
        x = torch.cat([self.class_embedding[None], patches])
        return x + self.position_embedding.weight[: x.shape[0]]


class CLIPVisionTower(nn.Module):
    """CLIP's vision transformer up to the layer whose output a LLaVA model takes (`num_layers` of
    them run; post_layernorm, which such models never use, is loaded and skipped)."""

    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = VisionEncoder(config, num_layers)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers:
            x = layer(x)
        return x
