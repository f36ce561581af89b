"""Phi-3 and Phi-4-mini: the Llama-like decoder, its checkpoint's q/k/v and gate/up already fused
(loaded whole into our fused layers), LongRoPE scaling (layers/rotary.py), and a partial rotary
(Phi-4-mini rotates 3/4 of each head: q and k rows are put in partial_rotary_order as they load,
so the full-width rotary kernels compute it)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedllm.layers.rotary import partial_rotary_order, rotary_dim
from pagedllm.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    fused_checkpoint = True
    stacked_params = ()  # the checkpoint's qkv_proj and gate_up_proj are ours, whole

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg = self.decoder_config
        rotated = rotary_dim(self.config, cfg.head_dim)
        if rotated < cfg.head_dim:
            weights = self._reorder_qk(weights, partial_rotary_order(cfg.head_dim, rotated))
        super().load_weights(weights)

    def _reorder_qk(self, weights: Iterable[tuple[str, torch.Tensor]], order: list[int]) -> Iterator:
        cfg = self.decoder_config
        index = torch.tensor(order)
        heads = cfg.num_heads + cfg.num_kv_heads
        for name, tensor in weights:
            if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
                if isinstance(tensor, torch.Tensor):
                    tensor = _reorder_rows(tensor, heads, cfg.head_dim, index)
                else:  # a GGUF file's quantized rows, as raw blocks: rows move whole
                    tensor.raw = _reorder_rows(tensor.raw, heads, cfg.head_dim, index)
            yield name, tensor


def _reorder_rows(rows: torch.Tensor, heads: int, head_dim: int, index: torch.Tensor) -> torch.Tensor:
    """The q and k rows of a fused q/k/v weight, each head's in `index` order; v's as they are."""
    qk = rows[: heads * head_dim].reshape(heads, head_dim, *rows.shape[1:])[:, index]
    return torch.cat([qk.reshape(-1, *rows.shape[1:]), rows[heads * head_dim :]])
