"""gpt-oss (OpenAI): a mixture of experts on every layer, attention with sinks (a learned logit per
head in each softmax's denominator), sliding and full layers alternating (layer_types), q/k/v/o
biases, YaRN rotary; its router has a bias and softmaxes the top-k logits (the full softmax's top-k
renormalized), and its experts' activation is a clamped SwiGLU: (up + 1) * gate * sigmoid(alpha
gate), gate clamped above at `swiglu_limit`, up within +-limit. The checkpoint stacks the experts,
gate_up_proj [experts, hidden, 2 x intermediate] with gate and up interleaved column by column,
down_proj [experts, intermediate, hidden], each with a bias: each expert's rows load as its own
gate, up and down projections. On one rank; in the C++ decoder stack (sinks in its attention,
the experts as kernels/moe.cpp's one call, the sliding and full layers' KV groups). llama.cpp's
gpt-oss files hold the experts de-interleaved, stacked (ffn_gate_exps, ...; MXFP4 as its converter
keeps the released weights), with their biases, and the sinks as attn_sinks."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from pagedllm.layers.linear import GateUpLinear, Linear
from pagedllm.layers.moe import CLAMPED_SWIGLU, ExpertSpec, expert_spec
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.decoder import Attention, DecoderConfig, DecoderLayer, linear_method
from pagedllm.models.gguf import GGUFFormat, family_config, field_value
from pagedllm.models.moe import AllSparseMoEForCausalLM

GGUF_LAYER_NAMES = {"attn_sinks": "self_attn.sinks", "post_attention_norm": "post_attention_layernorm"}


def gpt_oss_gguf_config(reader, values: dict):
    """llama.cpp's gpt-oss file: YaRN's factor and original context from its rope.scaling keys
    (beta_fast and beta_slow at llama.cpp's and transformers' defaults); the SwiGLU's limit and
    alpha, which no key holds, at gpt-oss's own (transformers' defaults)."""
    rope = {
        "rope_type": "yarn",
        "factor": float(field_value(reader, "gpt-oss.rope.scaling.factor")),
        "original_max_position_embeddings": int(field_value(reader, "gpt-oss.rope.scaling.original_context_length")),
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    }
    return family_config("GptOssConfig", "GptOssForCausalLM", values, rope)


class GptOssAttention(Attention):
    def __init__(
        self, cfg: DecoderConfig, sliding_window: int | None, quant: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__(cfg, sliding_window, quant, prefix)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))


class GptOssDecoderLayer(DecoderLayer):
    attention_class = GptOssAttention


class GptOssExpert(nn.Module):
    """down((up + 1) * glu(gate)), with biases; the clamped SwiGLU on the gate/up product."""

    def __init__(
        self, hidden: int, intermediate: int, quant: QuantizationConfig | None, prefix: str, alpha: float, limit: float
    ) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(
            hidden, 2 * intermediate, True, linear_method(quant, prefix, "gate_proj", "up_proj")
        )
        self.down_proj = Linear(intermediate, hidden, True, linear_method(quant, prefix, "down_proj"))
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))

    def kernel_spec(self) -> ExpertSpec | None:
        return expert_spec(self.gate_up_proj, self.down_proj, CLAMPED_SWIGLU, self.alpha, self.limit)


class GptOssForCausalLM(AllSparseMoEForCausalLM):
    gguf = GGUFFormat(GGUF_LAYER_NAMES, transformers_key="gpt_oss", config=gpt_oss_gguf_config)
    decoder_layer = GptOssDecoderLayer
    always_renormalize = True
    router_bias = True

    @staticmethod
    def make_expert(config) -> Callable[[int, int, QuantizationConfig | None, str], nn.Module]:
        return functools.partial(GptOssExpert, alpha=config.swiglu_alpha, limit=config.swiglu_limit)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_per_expert(weights))


def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's stacked experts as each expert's own tensors; the router as mlp.gate."""
    for name, tensor in weights:
        prefix, found, part = name.partition(".mlp.")
        if not found:  # (a GGUF file names the sinks as a weight)
            yield name.replace("self_attn.sinks.weight", "self_attn.sinks"), tensor
        elif part.startswith("router."):
            yield f"{prefix}.mlp.gate.{part.removeprefix('router.')}", tensor
        elif part in ("experts.gate_up_proj", "experts.gate_up_proj_bias"):
            kind = "weight" if part.endswith("proj") else "bias"
            for e, rows in enumerate(tensor):
                rows = rows.T if kind == "weight" else rows  # [2 x intermediate (interleaved), hidden]
                yield f"{prefix}.mlp.experts.{e}.gate_proj.{kind}", rows[0::2]
                yield f"{prefix}.mlp.experts.{e}.up_proj.{kind}", rows[1::2]
        elif part in ("experts.down_proj", "experts.down_proj_bias"):
            kind = "weight" if part.endswith("proj") else "bias"
            for e, rows in enumerate(tensor):
                yield f"{prefix}.mlp.experts.{e}.down_proj.{kind}", rows.T if kind == "weight" else rows
        else:  # a GGUF file's: each expert's own already
            yield name, tensor
