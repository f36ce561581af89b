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
        for name, tensor in weights:
            if name.endswith("self_attn.qkv_proj.weight") or name.endswith("self_attn.qkv_proj.bias"):
                heads = cfg.num_heads + cfg.num_kv_heads
                qk = tensor[:heads * cfg.head_dim].reshape(heads, cfg.head_dim, *tensor.shape[1:])
                tensor = torch.cat([qk[:, index].reshape(-1, *tensor.shape[1:]), tensor[heads * cfg.head_dim:]])
            yield name, tensor
