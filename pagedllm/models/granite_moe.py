"""Granite-MoE (IBM's Granite 3 MoE models): Granite's layers and multipliers (granite.py) with every
MLP a mixture of experts, its top-k weights a softmax over the k chosen logits (the full softmax's
top-k renormalized). The checkpoint stacks the experts: block_sparse_moe.input_linear [experts,
2 x intermediate (gate, then up), hidden], output_linear [experts, hidden, intermediate] and
router.layer; each expert's rows load as its own gate, up and down projections. llama.cpp's
granitemoe files stack them as the other MoE files do (ffn_gate_exps, ffn_up_exps, ffn_down_exps)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedllm.models.gguf import GGUFFormat, field_value
from pagedllm.models.granite import GraniteMultipliers, granite_gguf_config
from pagedllm.models.moe import AllSparseMoEForCausalLM


def granite_moe_gguf_config(reader, values: dict):
    """llama.cpp's granitemoe file: Granite's, with its experts' count and top-k."""
    experts = {
        "num_local_experts": int(field_value(reader, "granitemoe.expert_count")),
        "num_experts_per_tok": int(field_value(reader, "granitemoe.expert_used_count")),
    }
    return granite_gguf_config(reader, values, "granitemoe", **experts)


class GraniteMoeForCausalLM(GraniteMultipliers, AllSparseMoEForCausalLM):
    gguf = GGUFFormat(permuted_qk=True, transformers_key="llama", config=granite_moe_gguf_config)
    always_renormalize = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_per_expert(weights))


def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        prefix, found, part = name.partition(".block_sparse_moe.")
        if not found:
            yield name, tensor
        elif part == "router.layer.weight":
            yield f"{prefix}.mlp.gate.weight", tensor
        elif part == "input_linear.weight":
            for e, rows in enumerate(tensor):
                gate, up = rows.chunk(2)
                yield f"{prefix}.mlp.experts.{e}.gate_proj.weight", gate
                yield f"{prefix}.mlp.experts.{e}.up_proj.weight", up
        elif part == "output_linear.weight":
            for e, rows in enumerate(tensor):
                yield f"{prefix}.mlp.experts.{e}.down_proj.weight", rows
        else:
            raise ValueError(f"checkpoint tensor {name!r} has no place in GraniteMoeForCausalLM")
