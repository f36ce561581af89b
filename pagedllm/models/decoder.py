"""The decoder the Llama-like families share, on a flat token batch: attention (optional qkv bias,
optional per-head q/k RMSNorm, optional sliding window), the gated MLP, the decoder layer, the
model body, and DecoderForCausalLM, which each family's file subclasses with its options."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch
from torch import nn

from pagedllm.config import head_dim, kv_cache_groups, sliding_windows
from pagedllm.distributed.parallel_state import all_gather_shares, head_share, tensor_parallel
from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import (
    AttentionMetadata,
    KVScales,
    image_attention,
    paged_attention,
    rotary_and_write_kv,
)
from pagedllm.layers.linear import GateUpLinear, Linear, LinearMethodBase, QKVLinear, SiluAndMulLinear, load_weight
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary import RopeTables, RotaryEmbedding
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding, token_embedding
from pagedllm.models.interface import CausalLM, KVCache

logger = logging.getLogger(__name__)

# On the CPU, a long step's MLP goes in chunks of this many rows (as many as the bf16 kernel takes
# a call without AMX, layers/linear.py's ROWS_KERNEL_MAX): its intermediate activations (a layer's
# widest: [rows, intermediate]) then stay a few MiB whatever the step's tokens, which keeps a
# prefill's working set out of the resident set. The kernels compute each row on its own: the
# results are the same.
MLP_ROWS = 1024

# The C++ decoder stack takes a longer step through its layers in pieces of this many rows (as
# llama.cpp's default micro-batch), so that its buffers and a layer's intermediates hold a piece,
# not the step; every kernel computes a row on its own, so the results are the same.
PIECE_ROWS = 512


@dataclass(frozen=True)
class DecoderConfig:
    """What the layers take from a Hugging Face config and the family's options, worked out once."""

    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per layer: the attention window, or None for full attention
    tie_word_embeddings: bool
    # The checkpoint's names for the parts of our fused layers (Phi-3's checkpoint fuses them itself).
    qkv_parts: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    gate_up_parts: tuple[str, ...] = ("gate_proj", "up_proj")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def of(cls, config, always_qkv_bias: bool, qk_norm: bool, fused_checkpoint: bool = False) -> DecoderConfig:
        attention_bias = bool(getattr(config, "attention_bias", False))
        fused = {"qkv_parts": ("qkv_proj",), "gate_up_parts": ("gate_up_proj",)} if fused_checkpoint else {}
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim(config),
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=always_qkv_bias or attention_bias,
            o_bias=attention_bias,
            qk_norm=qk_norm,
            sliding_windows=sliding_windows(config),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            **fused,
        )


def linear_method(quant: QuantizationConfig | None, prefix: str, *parts: str) -> LinearMethodBase | None:
    """The method of the layer at `prefix` made of the checkpoint's modules `parts` (None: unquantized)."""
    return quant.linear_method([f"{prefix}.{part}".lstrip(".") for part in parts]) if quant is not None else None


class Attention(nn.Module):
    """Under tensor parallelism, this rank's heads (parallel_state.head_share); o_proj sums the
    ranks' outputs."""

    def __init__(
        self, cfg: DecoderConfig, sliding_window: int | None, quant: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__()
        share, d = head_share(cfg.num_heads, cfg.num_kv_heads), cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = share.q_count, share.kv_count, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        q_rows, kv_rows = (share.q_start * d, self.q_size), (share.kv_start * d, self.kv_size)
        self.qkv_proj = QKVLinear(
            cfg.hidden_size,
            cfg.q_size,
            cfg.kv_size,
            cfg.qkv_bias,
            linear_method(quant, prefix, *cfg.qkv_parts),
            "column",
            {"q": q_rows, "k": kv_rows, "v": kv_rows},
        )
        self.o_proj = Linear(
            cfg.q_size, cfg.hidden_size, cfg.o_bias, linear_method(quant, prefix, "o_proj"), "row", input_share=q_rows
        )
        self.qk_norm = cfg.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.sliding_window = sliding_window
        self.scale = self.head_dim**-0.5
        self.logit_softcap: float | None = None  # Gemma 2's attention scores: tanh(s / cap) * cap
        self.sinks: torch.Tensor | None = None  # gpt-oss's: a logit per head in each softmax
        self.use_rope = True  # False: no rotary embedding in this layer (SmolLM3's NoPE layers)
        self.kv_group = 0  # the group of layers whose block tables it reads (config.KVCacheGroups)
        # Of an fp8 KV cache: 1.0, as vLLM takes them where the checkpoint gives none.
        self.kv_scales = KVScales()

    def forward(self, x: torch.Tensor, rope: RopeTables, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        meta = meta.for_group(self.kv_group)
        qkv = self.qkv_proj(x)
        if self.qk_norm:
            self._norm_qk(qkv)
        if not self.use_rope:  # cos 1, sin 0: q and k as they are, through the same kernel
            rope = RopeTables(torch.ones_like(rope.cos), torch.zeros_like(rope.sin))
        q, _, _ = rotary_and_write_kv(
            qkv, rope, kv_cache[0], kv_cache[1], meta.slot_mapping, self.num_heads, self.kv_scales
        )
        cache = (kv_cache[0], kv_cache[1], meta)
        args = (*cache, self.scale, self.sliding_window, self.kv_scales, self.logit_softcap, self.sinks)
        out = paged_attention(q, *args)
        if meta.image_spans:
            image_attention(out, q, *args)
        return self.o_proj(out.reshape(-1, self.q_size))

    def kernel_spec(self) -> tuple | str:
        """Its part of a C++ decoder-stack layer (add_layer's qkv and o ops, q and k norm weights or
        None, window, fp8 scales, fp32 sinks or None, KV group), or why it has none. Its linear
        layers' ops come from their methods."""
        if self.logit_softcap is not None:
            return "the C++ decoder stack's layers take no soft-capped attention scores"
        if not self.use_rope:
            return "the C++ decoder stack rotates every layer's q and k (this model has layers without rotary)"
        norms = (self.q_norm.weight.detach(), self.k_norm.weight.detach()) if self.qk_norm else (None, None)
        ops = (self.qkv_proj.kernel_spec(), self.o_proj.kernel_spec())
        sinks = None if self.sinks is None else self.sinks.detach().float().contiguous()
        return (*ops, *norms, self.sliding_window or 0, self.kv_scales.k, self.kv_scales.v, sinks, self.kv_group)

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        """Per-head RMSNorm of q and k (Qwen3), written back into qkv. The heads are gathered into
        contiguous rows, as the fused kernel needs: one KV head's k of several tokens reshapes to a
        strided view, which went to the torch norm (other bits) where a lone token's went fused."""
        for norm, start, size in ((self.q_norm, 0, self.q_size), (self.k_norm, self.q_size, self.kv_size)):
            heads = qkv[:, start : start + size]
            heads.copy_(norm(heads.reshape(-1, self.head_dim).contiguous()).view(heads.shape))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)). `activation`: None for SiLU, fused into the gate/up layer (and
    the C++ kernels); else a function of gate/up's [.., 2n] output (Gemma's GELU-tanh-and-mul)."""

    def __init__(
        self,
        cfg: DecoderConfig,
        quant: QuantizationConfig | None,
        prefix: str,
        activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        method = linear_method(quant, prefix, *cfg.gate_up_parts)
        layer = SiluAndMulLinear if activation is None else GateUpLinear
        self.gate_up_proj = layer(cfg.hidden_size, 2 * cfg.intermediate_size, False, method, "column")
        self.activation = activation
        self.down_proj = Linear(
            cfg.intermediate_size, cfg.hidden_size, False, linear_method(quant, prefix, "down_proj"), "row"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.gate_up_proj.lora  # a step with adapters: its rows' slots are the whole step's
        if x.shape[0] <= MLP_ROWS or x.device.type != "cpu" or lora is not None and lora.ctx.active:
            return self._rows(x)
        out = x.new_empty(x.shape)
        for start in range(0, x.shape[0], MLP_ROWS):
            rows = slice(start, start + MLP_ROWS)
            out[rows] = self._rows(x[rows])
        return out

    def kernel_spec(self) -> tuple | str:
        """Its gate/up and down ops for the C++ decoder stack, or why it has none."""
        if self.activation is not None:
            return "the C++ decoder stack runs SiLU-gated MLPs only (not GELU)"
        return self.gate_up_proj.kernel_spec(), self.down_proj.kernel_spec()

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gated = self.gate_up_proj(x)
        return self.down_proj(gated if self.activation is None else self.activation(gated))


# A layer's MLP, made from (its index, its checkpoint prefix): the gated MLP, or a family's own
# (mixture-of-experts blocks).
MakeMLP = Callable[[int, str], nn.Module]


class DecoderLayer(nn.Module):
    # Each sublayer's output times this before it joins the residual (Granite's residual_multiplier).
    residual_multiplier = 1.0
    attention_class: ClassVar[type[Attention]] = Attention

    def __init__(
        self,
        cfg: DecoderConfig,
        sliding_window: int | None,
        quant: QuantizationConfig | None,
        prefix: str,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = self.attention_class(cfg, sliding_window, quant, f"{prefix}.self_attn")
        self.mlp = mlp if mlp is not None else GatedMLP(cfg, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def kernel_spec(self) -> tuple | str:
        """The C++ decoder stack's add_layer arguments for this layer (its norms, then its parts' own
        kernel_spec: qkv, o, gate/up and down ops, q and k norms, window, fp8 scales), or why it
        has none."""
        mlp_spec = getattr(self.mlp, "kernel_spec", None)
        if self.residual_multiplier != 1.0:
            return "the C++ decoder stack adds sublayer outputs to the residual unscaled (a residual multiplier)"
        if mlp_spec is None:
            return f"{type(self.mlp).__name__} has no kernel in the C++ decoder stack"
        attn, mlp = self.self_attn.kernel_spec(), mlp_spec()
        reason = next((part for part in (attn, mlp) if isinstance(part, str)), None)
        if reason is not None:
            return reason
        qkv, o, *attention_rest = attn
        norms = self.input_layernorm.weight.detach(), self.post_attention_layernorm.weight.detach()
        return (*norms, qkv, o, *mlp, *attention_rest)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeTables,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output; residual: the running sum (None before layer 0)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            residual, x = self.input_layernorm.add_and_norm(residual, x)
        x = self.self_attn(x, rope, kv_cache, meta)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        residual, x = self.post_attention_layernorm.add_and_norm(residual, x)
        x = self.mlp(x)
        return (x if self.residual_multiplier == 1.0 else x * self.residual_multiplier), residual


class DecoderModel(nn.Module):
    """The body: embeddings, rotary tables, decoder layers, final norm."""

    def __init__(
        self,
        config,
        cfg: DecoderConfig,
        max_positions: int,
        quant: QuantizationConfig | None,
        make_mlp: MakeMLP | None = None,
        layer_class: type[DecoderLayer] = DecoderLayer,
    ) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(quant, "model.embed_tokens", cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(config, cfg.head_dim, max_positions)
        self.layers = nn.ModuleList(
            layer_class(
                cfg, window, quant, f"model.layers.{i}", make_mlp(i, f"model.layers.{i}.mlp") if make_mlp else None
            )
            for i, window in enumerate(cfg.sliding_windows)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderForCausalLM(CausalLM):
    """The shared causal LM; a family's subclass sets its options below. `quant_config` gives each
    linear layer its method (None: all unquantized), and says whether the embedding stays
    quantized; a tied head is the embedding matrix itself, quantized or not."""

    # q, k and v carry biases whatever the config says (Qwen2).
    always_qkv_bias: ClassVar[bool] = False
    # RMSNorm of each q and k head before rotary (Qwen3).
    qk_norm: ClassVar[bool] = False
    # The checkpoint holds q/k/v and gate/up fused already (Phi-3), loaded whole.
    fused_checkpoint: ClassVar[bool] = False
    # The layer the body is made of (OLMo 2: norms after each sublayer, not before).
    decoder_layer: ClassVar[type[DecoderLayer]] = DecoderLayer
    # (our fused parameter, the checkpoint's name for one shard of it, that shard's id).
    stacked_params: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    # The decoder layers as one C++ call (kernels/decoder_stack.cpp), where bind_kernels found a
    # kernel for every op of theirs; else None, and forward runs them op by op. A documented test
    # hook: tests set it to None to run the op-by-op path, or wrap it to count its calls.
    stack = None
    # Whether the family's layers split over tensor-parallel ranks (the shared decoder's do; a
    # family with layers of its own says so where they do).
    supports_tensor_parallel: ClassVar[bool] = True
    _head_from_embedding = False  # (set in __init__: a tensor-parallel head on a quantized tied table)

    def __init__(self, config, max_positions: int, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        cfg = self.decoder_config = self.make_decoder_config(config)
        self.model = self.build_model(config, cfg, max_positions, quant_config)
        self.kv_groups = kv_cache_groups(config)
        for layer, group in zip(self.model.layers, self.kv_groups.layer_group):
            layer.self_attn.kv_group = group
        embedding = self.model.embed_tokens
        # Under tensor parallelism a quantized tied table is two: the embedding's rows dequantized
        # (VocabParallelEmbedding) and the head's rows kept quantized, as one rank's head computes.
        self._head_from_embedding = (
            cfg.tie_word_embeddings
            and isinstance(embedding, VocabParallelEmbedding)
            and quant_config is not None
            and quant_config.quantized_embedding("model.embed_tokens")
        )
        tied_head = quant_config.tied_head(embedding) if cfg.tie_word_embeddings and quant_config else None
        if tied_head is not None:  # the format's own (GGUF: computing on the quantized table)
            self.lm_head = tied_head
        else:
            head_method = (
                linear_method(quant_config, "", "model.embed_tokens")
                if self._head_from_embedding
                else None
                if cfg.tie_word_embeddings
                else linear_method(quant_config, "", "lm_head")
            )
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, method=head_method, parallel="column")

    def make_decoder_config(self, config) -> DecoderConfig:
        """What the layers are built from; a family whose layers need more says it (DeepSeek's MLA)."""
        return DecoderConfig.of(config, self.always_qkv_bias, self.qk_norm, self.fused_checkpoint)

    def build_model(
        self, config, cfg: DecoderConfig, max_positions: int, quant: QuantizationConfig | None
    ) -> nn.Module:
        """The body (embeddings, layers, final norm); a family with other layers builds its own."""
        return DecoderModel(config, cfg, max_positions, quant, layer_class=self.decoder_layer)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds`: the step's embeddings where a caller made them (a vision-language
        model's, with images' rows in them), else `input_ids` are embedded here."""
        x, residual = self.embed(input_ids) if inputs_embeds is None else inputs_embeds, None
        rope = self.model.rotary.tables(positions)  # once per step, shared by every layer
        if self.stack is not None:
            meta = attn_metadata
            return self.stack.forward(
                x,
                rope.cos,
                rope.sin,
                kv_caches,
                meta.slot_mapping,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                meta.group_tables,
            )
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, attn_metadata)
        return self.model.norm.add_and_norm(residual, x)[1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Tensor parallelism: each rank's vocabulary share, gathered (every rank samples alike).
        return all_gather_shares(self.lm_head(hidden), self.decoder_config.vocab_size).float()

    def bind_kernels(self) -> None:
        """Hand the decoder layers to the C++ stack if every op of theirs has a kernel there (bf16
        or fp32; each layer's kernel_spec, made from its parts' own: linear methods with a
        kernel_spec, a SiLU-gated MLP, q/k norm weights); else say once why they run op by op. The
        stack's results are the op-by-op path's, bit for bit, without that path's Python between
        kernels (docs/benchmarks-history.md has what it saves)."""
        self.stack = None
        on_cpu = self.model.norm.weight.device.type == "cpu"
        ops = cpu_ops() if on_cpu else None  # (never built for another device)
        reason = self._stack_blocker(ops) if on_cpu else f"its weights are on {self.model.norm.weight.device.type}"
        if reason is not None:
            logger.info("%s runs its decoder layers op by op: %s", type(self).__name__, reason)
            return
        cfg, norm = self.decoder_config, self.model.norm
        stack = ops.DecoderStack(
            cfg.num_heads,
            cfg.head_dim,
            norm.eps,
            self.model.layers[0].self_attn.scale,
            norm.weight.detach(),
            MLP_ROWS,
            PIECE_ROWS,
        )
        for layer in self.model.layers:
            stack.add_layer(*layer.kernel_spec())
        lora = next((m.lora for m in self.model.layers.modules() if isinstance(m, Linear) and m.lora), None)
        if lora is not None:
            stack.set_lora(lora.ctx.native)
        self.stack = stack

    def _stack_blocker(self, ops: ModuleType | None) -> str | None:
        """Why the C++ stack cannot take the decoder layers; None where it can."""
        if ops is None:
            return "the C++ kernels are unavailable"
        if tensor_parallel().size > 1:
            return "tensor parallelism sums each layer's outputs over the ranks, between the stack's kernels"
        if self.model.norm.weight.dtype not in (torch.bfloat16, torch.float32):
            return f"the C++ decoder stack computes in bf16 or fp32, the weights are {self.model.norm.weight.dtype}"
        for layer in self.model.layers:  # each layer says whether its parts plug in, and if not why
            spec = getattr(layer, "kernel_spec", None)
            reason = f"{type(layer).__name__} has no kernel in the C++ decoder stack" if spec is None else spec()
            if isinstance(reason, str):
                return reason
        for name, module in self.model.layers.named_modules(prefix="model.layers"):
            if isinstance(module, Linear) and module.kernel_spec() is None:
                return (
                    f"{name} ({type(module).__name__} with {type(module.method).__name__}) has no kernel "
                    "in the C++ decoder stack"
                )
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if (
            self.decoder_config.tie_word_embeddings
            and isinstance(self.lm_head, Linear)
            and not self._head_from_embedding
        ):
            # tied here, once materialized (packing copies it)
            self.lm_head.weight = self.model.embed_tokens.weight
        params = dict(self.named_parameters())
        missing = {(name, shard) for name in params for shard in self._shards_of(name)}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.decoder_config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if self._head_from_embedding and name == "model.embed_tokens.weight":
                load_weight(params["lm_head.weight"], tensor, None, name)
                missing.discard(("lm_head.weight", None))
            target, shard = self._target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            load_weight(params[target], tensor, shard, name)
            missing.discard((target, shard))
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {sorted(n for n, _ in missing)[:5]}")

    def _shards_of(self, name: str) -> tuple[str | int | None, ...]:
        """The shards a parameter is filled from: its fused layer's, else (None,), whole."""
        return tuple(shard for fused, _, shard in self.stacked_params if f".{fused}." in name) or (None,)

    def _target(self, name: str) -> tuple[str, str | int | None]:
        """A checkpoint name -> (our parameter's name, the shard it fills or None)."""
        parts = name.split(".")
        for fused, part, shard in self.stacked_params:
            if part in parts:
                i = parts.index(part)
                return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
        return name, None
