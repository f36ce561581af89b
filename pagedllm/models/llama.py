"""The Llama family on a flat token batch: Llama (incl. Llama-3 rope), Mistral, Qwen2, Qwen3.

One class covers them; the config decides qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3),
sliding-window layers (Mistral, Qwen2) and tied embeddings.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import AttentionMetadata, paged_attention, rotary_and_write_kv
from pagedllm.config import head_dim
from pagedllm.layers.linear import ROWS_KERNEL_MAX, Linear, SiluAndMulLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RopeTables, RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


def _sliding_windows(config) -> list[int | None]:
    """Per layer: the attention window, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * config.num_hidden_layers


class Attention(nn.Module):
    def __init__(self, config, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bool(getattr(config, "attention_bias", False)))
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.sliding_window = sliding_window
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: RopeTables, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.qk_norm:
            self._norm_qk(qkv)
        q, k, v = rotary_and_write_kv(qkv, rope, kv_cache[0], kv_cache[1], meta.slot_mapping, self.num_heads)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        """Qwen3's per-head RMSNorm of q and k, written back into qkv."""
        for norm, start, size in ((self.q_norm, 0, self.q_size), (self.k_norm, self.q_size, self.kv_size)):
            heads = qkv[:, start:start + size]
            heads.copy_(norm(heads.reshape(-1, self.head_dim)).view(heads.shape))


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = SiluAndMulLinear(config.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = Attention(config, sliding_window)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeTables, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output; residual: the running sum (None before layer 0)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            residual, x = self.input_layernorm.add_and_norm(residual, x)
        x = self.self_attn(x, rope, kv_cache, meta)
        residual, x = self.post_attention_layernorm.add_and_norm(residual, x)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config, head_dim(config), max_positions)
        self.layers = nn.ModuleList(DecoderLayer(config, w) for w in _sliding_windows(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # Hugging Face checkpoint names that land in one of our fused weights, with the shard index.
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    # The decoder layers as one C++ call (kernels/decoder_stack.cpp), where bind_kernels found a
    # kernel for every op of theirs; else None, and forward runs them op by op.
    _stack = None

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None
        rope = self.model.rotary.tables(positions)  # once per step, shared by every layer
        if self._stack is not None:
            return self._stack.forward(x, rope.cos, rope.sin, kv_caches, meta.slot_mapping, meta.block_tables,
                                       meta.query_start_loc, meta.seq_lens)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.model.norm.add_and_norm(residual, x)[1]

    def bind_kernels(self) -> None:
        """Once the weights are packed: hand the decoder layers to the C++ stack if every op of theirs
        has a kernel there (bf16 with AVX512-BF16, packed weights, attention's query tiles, no
        per-head q/k norm). Its results are the op-by-op path's, bit for bit; it saves that path's
        Python between kernels, about 1 ms a step on a 16-layer model."""
        self._stack = None
        ops, attn = cpu_ops(), self.model.layers[0].self_attn
        if (ops is None or attn.qk_norm or self.model.norm.weight.dtype != torch.bfloat16
                or not ops.attention_has_query_tiles(attn.head_dim, attn.num_heads // attn.num_kv_heads)):
            return
        specs = [[linear.kernel_spec() for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj)]
                 for layer in self.model.layers]
        if any(spec is None for layer_specs in specs for spec in layer_specs):
            return
        stack = ops.DecoderStack(attn.num_heads, attn.head_dim, self.model.norm.eps, attn.scale,
                                 self.model.norm.weight.detach(), ROWS_KERNEL_MAX)
        for layer, layer_specs in zip(self.model.layers, specs):
            stack.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                            *layer_specs, layer.self_attn.sliding_window or 0)
        self._stack = stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in; every parameter must be filled exactly once."""
        if self.tie_word_embeddings:  # tied here, once the module is materialized (packing copies it)
            self.lm_head.weight = self.model.embed_tokens.weight
        params = dict(self.named_parameters())
        missing = {(name, shard) for name in params for shard in self._shards_of(name)}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, shard = self._target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            dest = param.data if shard is None else self._shard_view(target, param.data, shard)
            if dest.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(dest.shape)}")
            dest.copy_(tensor)
            missing.discard((target, shard))
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {sorted(n for n, _ in missing)[:5]}")

    @staticmethod
    def _shards_of(name: str) -> tuple[int | None, ...]:
        if ".qkv_proj." in name:
            return (0, 1, 2)
        return (0, 1) if ".gate_up_proj." in name else (None,)

    def _target(self, name: str) -> tuple[str, int | None]:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self._FUSED:
                fused, shard = self._FUSED[part]
                return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
        return name, None

    def _shard_view(self, target: str, data: torch.Tensor, shard: int) -> torch.Tensor:
        if "qkv_proj" in target:
            attn = self.model.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:shard])
        return data.narrow(0, start, sizes[shard])
