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

from pagedllm.kernels import cpu_ops
from pagedllm.layers.linear import KernelSpec, Linear, SiluAndMulLinear
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

    def kernel_spec(self) -> ExpertSpec | None:
        """Its ops for kernels/moe.cpp (SiLU-and-mul fused into gate/up's), or None where a layer has none."""
        return expert_spec(self.gate_up_proj, self.down_proj, FUSED_ACTIVATION)


# An expert as kernels/moe.cpp runs it: its gate/up and down ops, then the activation between them
# (FUSED_ACTIVATION: none, the gate/up op applies SiLU-and-mul; CLAMPED_SWIGLU: gpt-oss's) and that
# activation's alpha and limit.
ExpertSpec = tuple[KernelSpec, KernelSpec, int, float, float]
FUSED_ACTIVATION, CLAMPED_SWIGLU = 0, 1


def expert_spec(
    gate_up: Linear, down: Linear, activation: int, alpha: float = 0.0, limit: float = 0.0
) -> ExpertSpec | None:
    ops = gate_up.kernel_spec(), down.kernel_spec()
    return None if None in ops else (*ops, activation, alpha, limit)


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
        # The routed experts as one C++ call (kernels/moe.cpp), where bind_kernel found ops for them.
        self.native: object | None = None

    def bind_kernel(self) -> str | None:
        """Hand the router and the experts to kernels/moe.cpp's one call if each of their linear
        layers has a C++ op; else say why they run op by op. The call's routing, experts and sums
        are this module's, rounded where its torch ops round."""
        self.native = None
        if self.gate.weight.device.type != "cpu":
            return f"its weights are on {self.gate.weight.device.type}"
        ops = cpu_ops()
        if ops is None:
            return "the C++ kernels are unavailable"
        router = self.gate.kernel_spec()
        specs = [getattr(expert, "kernel_spec", lambda: None)() for expert in self.experts]
        if router is None or None in specs:
            return "a router or expert layer has no C++ op"
        if len({spec[2:] for spec in specs}) != 1:
            return "the experts' activations differ"
        activation, alpha, limit = specs[0][2:]
        gate_ups, downs = [spec[0] for spec in specs], [spec[1] for spec in specs]
        groups = self.groups or (0, 0)
        self.native = ops.SparseMoE(
            router, gate_ups, downs, self.top_k, self.renormalize, self.routed_scale, *groups, activation, alpha, limit
        )
        return None

    def kernel_spec(self) -> tuple | str:
        """The C++ decoder stack's MLP ops for this block (no gate/up op; the one call as down), or
        why it has none."""
        if self.native is None:
            return "its experts have no C++ op"
        if self.shared_expert is not None:
            return "the C++ decoder stack runs no shared expert beside the routed ones"
        return None, self.native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.native(x) if self.native is not None and x.device.type == "cpu" else self._routed(x)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum, op by op."""
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
