"""A mixture-of-experts MLP: a router picks each token's top-k experts; each expert then runs once
on the tokens routed to it (grouped, never every expert on every token) and their outputs, weighted
by the router, are summed per token. Each expert is a gated MLP of the shared linear layers, so
whatever method a linear layer has (bf16 packed, GGUF quantized, int8/int4) its experts have too.
Optionally a shared expert every token goes through, scaled by a sigmoid gate (Qwen2-MoE) or not
(DeepSeek's shared experts, one MLP as wide as they are together)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import Linear, SiluAndMulLinear
from pagedllm.layers.quantization import QuantizationConfig


def _method(quant: QuantizationConfig | None, prefix: str, *parts: str):
    return quant.linear_method([f"{prefix}.{part}" for part in parts]) if quant is not None else None


class Expert(nn.Module):
    """One expert: down(silu(gate(x)) * up(x)) (the checkpoint's gate_proj and up_proj fused)."""

    def __init__(self, hidden: int, intermediate: int, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = SiluAndMulLinear(
            hidden, 2 * intermediate, False, _method(quant, prefix, "gate_proj", "up_proj")
        )
        self.down_proj = Linear(intermediate, hidden, False, _method(quant, prefix, "down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class SparseMoE(nn.Module):
    """`renormalize`: the top-k probabilities rescaled to sum to 1 (Qwen3-MoE's norm_topk_prob,
    Mixtral); else the full softmax's values are kept (Qwen2-MoE's default). `router_bias`: the
    router's logits have a bias (gpt-oss); `expert`: what an expert is made by (hidden,
    intermediate, quant, prefix), Expert's gated MLP unless a family has its own. DeepSeek's
    options: `shared_gate` False (its shared experts' output added as it is), `routed_scale`
    (the routed experts' weights times routed_scaling_factor) and `groups` (n_group, topk_group):
    the experts in n_group groups, each token's top-k taken from its topk_group groups of highest
    best expert (group-limited greedy)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        quant: QuantizationConfig | None,
        prefix: str,
        shared_intermediate: int = 0,
        router_bias: bool = False,
        expert: Callable[[int, int, QuantizationConfig | None, str], nn.Module] = Expert,
        shared_gate: bool = True,
        routed_scale: float = 1.0,
        groups: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.routed_scale, self.groups = routed_scale, groups
        self.gate = Linear(hidden, num_experts, bias=router_bias)  # the router, unquantized as llama.cpp keeps it
        self.experts = nn.ModuleList(
            expert(hidden, intermediate, quant, f"{prefix}.experts.{e}") for e in range(num_experts)
        )
        self.shared_expert = (
            Expert(hidden, shared_intermediate, quant, f"{prefix}.shared_expert") if shared_intermediate else None
        )
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared_intermediate and shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        # (token, expert) pairs grouped by expert: each expert computes its own tokens at once.
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                rows = order[start : start + count]
                picked = tokens[start : start + count]
                y = expert(x[picked]) * weights.flatten()[rows, None]
                out.index_add_(0, picked, y)
                start += count
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k (weights in x's dtype, expert ids), from the router's softmax in fp32."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        if self.groups is not None:
            probs = _best_groups_only(probs, *self.groups)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        return weights.to(x.dtype), experts


def _best_groups_only(probs: torch.Tensor, num_groups: int, keep: int) -> torch.Tensor:
    """probs [tokens, experts] with every expert outside each token's `keep` groups (of
    `num_groups` of consecutive experts) of highest best probability set to 0."""
    grouped = probs.view(probs.shape[0], num_groups, -1)
    best = torch.topk(grouped.amax(dim=-1), keep, dim=-1).indices
    kept = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=probs.device).scatter_(1, best, True)
    return grouped.masked_fill(~kept[..., None], 0.0).view_as(probs)
