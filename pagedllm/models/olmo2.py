"""OLMo 2 (AI2): the Llama-like decoder with its norms after each sublayer instead of before (each
sublayer's output RMS-normed, then added to the residual; the residual itself goes in), and q and k
RMS-normed over all their heads at once (one weight of q's width, one of k's) before rotary. Op by
op (the C++ stack norms before each sublayer, per head), on one rank (the q/k norm spans every
rank's heads). llama.cpp's olmo2 files keep transformers' Q/K rows, with the norms as
attn_q_norm, attn_k_norm, post_attention_norm and post_ffw_norm."""

from __future__ import annotations

import torch

from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary import RopeTables
from pagedllm.models.decoder import Attention, DecoderConfig, DecoderForCausalLM, DecoderLayer
from pagedllm.models.gguf import GGUFFormat, family_config
from pagedllm.models.interface import KVCache


class Olmo2Attention(Attention):
    def __init__(
        self, cfg: DecoderConfig, sliding_window: int | None, quant: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__(cfg, sliding_window, quant, prefix)
        self.qk_norm = True
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        for norm, start, size in ((self.q_norm, 0, self.q_size), (self.k_norm, self.q_size, self.kv_size)):
            part = qkv[:, start : start + size]
            part.copy_(norm(part.contiguous()))


class Olmo2DecoderLayer(DecoderLayer):
    attention_class = Olmo2Attention

    def __init__(self, cfg: DecoderConfig, sliding_window: int | None, quant, prefix: str, mlp=None) -> None:
        super().__init__(cfg, sliding_window, quant, prefix, mlp)
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def kernel_spec(self) -> tuple | str:
        return "the C++ decoder stack norms each sublayer's input (OLMo 2 norms its output)"

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeTables,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's normed output (the embeddings before layer 0); residual: the
        running sum before it (None before layer 0)."""
        residual = x if residual is None else residual + x
        residual = residual + self.post_attention_layernorm(self.self_attn(residual, rope, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


def olmo2_gguf_config(reader, values: dict):
    return family_config("Olmo2Config", "Olmo2ForCausalLM", values)


class Olmo2ForCausalLM(DecoderForCausalLM):
    gguf = GGUFFormat(
        {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
        transformers_key="llama",
        config=olmo2_gguf_config,
    )
    decoder_layer = Olmo2DecoderLayer
    supports_tensor_parallel = False
