"""Gemma 3 (text) and Gemma 2: the shared attention and linear layers in Gemma's own layer.

What differs from the Llama-like decoder: RMSNorms whose weight is an offset from 1, scaled in
fp32 (GemmaRMSNorm); a norm after attention and after the MLP as well as before each, with the
residual added after them; a GELU(tanh)-gated MLP; embeddings scaled by sqrt(hidden_size); per-head
q/k norms; attention scaled by query_pre_attn_scalar ** -0.5; sliding-window layers interleaved
with full ones (config.layer_types), each kind with its own rotary base; optional tanh soft-capping
of the final logits. Its layers run op by op (the C++ decoder stack knows none of this)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.activation import gelu_tanh_and_mul
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary import RopeTables, RotaryEmbedding
from pagedllm.layers.vocab_embedding import token_embedding
from pagedllm.models.decoder import Attention, DecoderConfig, DecoderForCausalLM, GatedMLP
from pagedllm.models.gguf import GGUFFormat, field_value
from pagedllm.models.interface import KVCache

# Gemma's turn format, for files that carry no template (the GGUF of Gemma 3 270M): a system
# message goes at the head of the first user turn; the assistant's role is "model".
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    '{%- set first_is_system = messages and messages[0].role in ("system", "developer") -%}'
    '{%- set ns = namespace(prefix=(messages[0].content ~ "\\n\\n") if first_is_system else "") -%}'
    "{%- for message in messages -%}"
    "{%- if not (loop.first and first_is_system) -%}"
    '{{- "<start_of_turn>" ~ ("model" if message.role == "assistant" else "user") ~ "\\n" ~ ns.prefix'
    ' ~ (message.content | trim) ~ "<end_of_turn>\\n" -}}'
    '{%- set ns.prefix = "" -%}'
    "{%- endif -%}"
    "{%- endfor -%}"
    '{%- if add_generation_prompt -%}{{- "<start_of_turn>model\\n" -}}{%- endif -%}'
)


# Gemma's files name its four norms otherwise: its "ffn_norm" is the norm before the MLP.
GGUF_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gguf_eos(reader, eos: int | None) -> list[int]:
    """Gemma's chat turns end with <end_of_turn>, which its generation config lists beside <eos> and
    llama.cpp stops on; the GGUF file names only <eos>."""
    ids = [] if eos is None else [int(eos)]
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    if tokens is not None and "<end_of_turn>" in tokens:
        ids.append(tokens.index("<end_of_turn>"))
    return ids


def gemma3_gguf_config(reader, values: dict):
    """Gemma 3's config class, as transformers reads such a file: what GGUF does not say (the
    pattern of sliding and full layers, the local rotary base, query_pre_attn_scalar) takes the
    class's defaults, which are llama.cpp's too."""
    from transformers import Gemma3TextConfig

    values = {k: v for k, v in values.items() if k != "model_type"}
    values["eos_token_id"] = gguf_eos(reader, values.get("eos_token_id"))
    return Gemma3TextConfig(**values, architectures=["Gemma3ForCausalLM"])


def gemma2_gguf_config(reader, values: dict):
    """Gemma 2's config class with the file's soft-caps. The file does not say how queries are
    scaled: as llama.cpp does, by the head size, but for the 27B model (46 layers) by hidden / heads."""
    from transformers import Gemma2Config

    values = {k: v for k, v in values.items() if k != "model_type"}
    values["eos_token_id"] = gguf_eos(reader, values.get("eos_token_id"))
    caps = {
        name: float(field_value(reader, f"gemma2.{name}"))
        for name in ("attn_logit_softcapping", "final_logit_softcapping")
        if field_value(reader, f"gemma2.{name}") is not None
    }
    per_head = values["hidden_size"] // values["num_attention_heads"]
    scalar = per_head if values["num_hidden_layers"] == 46 else values.get("head_dim", per_head)
    return Gemma2Config(**values, **caps, query_pre_attn_scalar=scalar, architectures=["Gemma2ForCausalLM"])


class Gemma3Attention(Attention):
    def __init__(
        self, config, cfg: DecoderConfig, window: int | None, quant: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__(cfg, window, quant, prefix)
        if cfg.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.logit_softcap = getattr(config, "attn_logit_softcapping", None)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, config, cfg: DecoderConfig, window: int | None, quant: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, cfg, window, quant, f"{prefix}.self_attn")
        self.mlp = GatedMLP(cfg, quant, f"{prefix}.mlp", gelu_tanh_and_mul)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, rope: RopeTables, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, config, cfg: DecoderConfig, max_positions: int, quant: QuantizationConfig | None) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(quant, "model.embed_tokens", cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size**0.5
        self.layer_types = list(config.layer_types)
        # Each kind of layer rotates with its own base (Gemma 3: 10k local, 1M global); Gemma 2's
        # config has one set of rope parameters for all.
        per_kind = all(kind in (config.rope_parameters or {}) for kind in self.layer_types)
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(config, cfg.head_dim, max_positions, kind if per_kind else None)
                for kind in sorted(set(self.layer_types))
            }
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, cfg, window, quant, f"model.layers.{i}")
            for i, window in enumerate(cfg.sliding_windows)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3ForCausalLM(DecoderForCausalLM):
    supports_tensor_parallel = False  # its own layers, not split over ranks yet
    qk_norm = True
    default_chat_template = CHAT_TEMPLATE
    gguf = GGUFFormat(GGUF_LAYER_NAMES, norm_plus_one=True, config=gemma3_gguf_config)

    def __init__(self, config, max_positions: int, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, max_positions, quant_config)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def build_model(
        self, config, cfg: DecoderConfig, max_positions: int, quant: QuantizationConfig | None
    ) -> nn.Module:
        return Gemma3Model(config, cfg, max_positions, quant)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        ropes = {kind: rotary.tables(positions) for kind, rotary in self.model.rotary.items()}
        for layer, kind, kv_cache in zip(self.model.layers, self.model.layer_types, kv_caches):
            x = layer(x, ropes[kind], kv_cache, attn_metadata)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.model.embed_scale).to(
            x.dtype
        )  # an fp32 scalar in the model's dtype, as HF rounds it

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _stack_blocker(self, ops) -> str | None:
        return "Gemma's layers (norms after attention and MLP, GELU) have no kernel in the C++ decoder stack"


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's layer without q/k norms, one rotary base for all layers, attention scores
    soft-capped (tanh(s / cap) * cap, computed by the torch attention: the kernels have no cap)."""

    qk_norm = False
    gguf = GGUFFormat(GGUF_LAYER_NAMES, norm_plus_one=True, config=gemma2_gguf_config)
