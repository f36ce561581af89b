"""DeepSeek-V2 and V2-Lite: multi-head latent attention (MLA) and a mixture of experts with shared
experts.

MLA: a token's keys and values all come from one compressed vector c (kv_lora_rank wide, RMS-normed)
and one rotary key k_pe (qk_rope_head_dim wide) that every head shares. The cache holds [c, k_pe]
once a token (config.KVCacheShape's latent cache: DeepSeek-V2-Lite's 576 values a token and layer,
against 16 heads x (192 + 128) for its expanded K and V). Attention runs in the latent space: a
head's no-rotary query goes through its slice of kv_b_proj's key half (q_nope W_UK, kv_lora_rank
wide) and joins its rotated q_pe, so that its score over a cached row [c, k_pe] is transformers'
q.k; the same rows serve as the values, and a head's output over c goes through its slice of the
value half (W_UV) into o_proj. The softmax scale is 1/sqrt(qk_nope + qk_rope), times YaRN's
mscale(factor, mscale_all_dim) squared.

The checkpoint's rotary dims are pairs of neighbours (transformers turns them as complex numbers);
q_pe's and k_pe's rows load evens first, then odds (rotate-half's layout, which turns them alike and
leaves every q.k as it was).

MLP: the first first_k_dense_replace layers dense; then a softmax router's top-k experts (greedy, or
group-limited: from the topk_group groups of highest best expert), their weights times
routed_scaling_factor, plus the shared experts (one MLP, n_shared_experts x moe_intermediate_size
wide, ungated). Op by op (the C++ stack has no latent attention), on one rank.

llama.cpp's deepseek2 files keep transformers' rotary rows (its rotary pairs neighbours too) and
split kv_b_proj as the latent attention uses it: attn_k_b [heads, kv_lora_rank, nope] (each head's
W_UK transposed) and attn_v_b [heads, v, kv_lora_rank]; their metadata give the latent's sizes,
one K/V head and the MLA head sizes (key_length_mla, value_length_mla)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn

from pagedllm.layers.attention import AttentionMetadata, KVScales, paged_attention, write_rows
from pagedllm.layers.linear import Linear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.quantization.gguf import GGUFTensor
from pagedllm.layers.rotary import RopeTables, apply_rotary
from pagedllm.models.decoder import DecoderConfig, DecoderLayer, linear_method
from pagedllm.models.gguf import GGUFFormat, family_config, field_value
from pagedllm.models.interface import KVCache
from pagedllm.models.moe import SparseMoEForCausalLM

GGUF_LAYER_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # (older files: whole, as the checkpoint has it)
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
}


def deepseek2_gguf_config(reader, values: dict):
    """DeepSeek-V2's config from a deepseek2 file (llama's keys read as transformers maps them, the
    K/V heads being the query heads' count: the file's one is the latent's). Its experts' groups
    where it gives them; YaRN's mscale and mscale_all_dim both from its log multiplier (0.1 x
    mscale_all_dim; DeepSeek-V2's configs set the two alike)."""

    def key(name: str, default=None):
        value = field_value(reader, f"deepseek2.{name}")
        return default if value is None else value

    if key("expert_gating_func", 1) != 1:
        raise ValueError("a deepseek2 GGUF file whose experts are gated by a sigmoid (DeepSeek-V3's) is not supported")
    rope_dim = int(key("rope.dimension_count"))
    groups = int(key("expert_group_count", 1))
    fields = dict(
        num_key_value_heads=values["num_attention_heads"],
        q_lora_rank=int(key("attention.q_lora_rank")) if key("attention.q_lora_rank") else None,
        kv_lora_rank=int(key("attention.kv_lora_rank")),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=int(key("attention.key_length_mla")) - rope_dim,
        v_head_dim=int(key("attention.value_length_mla")),
        n_routed_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")),
        n_shared_experts=int(key("expert_shared_count", 0)),
        first_k_dense_replace=int(key("leading_dense_block_count", 0)),
        routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(key("expert_weights_norm", False)),
        topk_method="group_limited_greedy" if groups > 1 else "greedy",
        n_group=groups if groups > 1 else None,
        topk_group=int(key("expert_group_used_count")) if groups > 1 else None,
    )
    rope = None
    if key("rope.scaling.type") == "yarn":
        mscale = float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope = {
            "rope_type": "yarn",
            "factor": float(key("rope.scaling.factor")),
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            "mscale": mscale,
            "mscale_all_dim": mscale,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        }
    values = {k: v for k, v in values.items() if k not in ("head_dim", "num_key_value_heads")}
    return family_config("DeepseekV2Config", "DeepseekV2ForCausalLM", values, rope, **fields)


LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm: RMSNorm's default, not the config's


@dataclass(frozen=True)
class MLAConfig(DecoderConfig):
    q_lora_rank: int | None = None  # None: q_proj; else q_a_proj, its norm, q_b_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    softmax_scale: float = 1.0


def softmax_scale(config) -> float:
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class PerHead(nn.Module):
    """[tokens, heads, in] -> [tokens, heads, out]: each head through a linear layer of its own
    (each row computed alone, whatever else its step holds)."""

    def __init__(self, heads: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(Linear(in_features, out_features, bias=False) for _ in range(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([layer(x[:, h].contiguous()) for h, layer in enumerate(self.heads)], dim=1)


class MLAAttention(nn.Module):
    def __init__(
        self, cfg: MLAConfig, sliding_window: int | None, quant: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__()
        heads, hidden = cfg.num_heads, cfg.hidden_size
        self.num_heads, self.rank, self.rope_dim = heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        q_size = heads * (self.nope_dim + self.rope_dim)
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_size, False, linear_method(quant, prefix, "q_proj"))
        else:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, cfg.o_bias, linear_method(quant, prefix, "q_a_proj"))
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_size, False, linear_method(quant, prefix, "q_b_proj"))
        self.kv_a_proj_with_mqa = Linear(
            hidden, self.rank + self.rope_dim, cfg.o_bias, linear_method(quant, prefix, "kv_a_proj_with_mqa")
        )
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.k_up = PerHead(heads, self.nope_dim, self.rank)  # W_UK, each head's [rank, nope]
        self.v_up = PerHead(heads, self.rank, self.v_dim)  # W_UV, each head's [v, rank]
        self.o_proj = Linear(heads * self.v_dim, hidden, cfg.o_bias, linear_method(quant, prefix, "o_proj"))
        self.scale = cfg.softmax_scale
        self.kv_group = 0  # (config.KVCacheGroups: one group, no windows)
        self.kv_scales = KVScales()  # of an fp8 cache: 1.0 (the one tensor is K and V alike)

    def forward(self, x: torch.Tensor, rope: RopeTables, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens, cache = x.shape[0], kv_cache[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        key = torch.cat([self.kv_a_layernorm(c.contiguous()), _rotated(k_pe[:, None], rope)[:, 0]], dim=-1)
        write_rows(cache, key[:, None], meta.slot_mapping, self.kv_scales.k)
        query = torch.cat([self.k_up(q_nope), _rotated(q_pe, rope)], dim=-1)
        out = paged_attention(query, cache, cache, meta, self.scale, None, self.kv_scales)
        return self.o_proj(self.v_up(out[..., : self.rank]).reshape(tokens, -1))

    def kernel_spec(self) -> str:
        return "the C++ decoder stack has no multi-head latent attention"


def _rotated(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """Rotary in fp32 (as transformers turns DeepSeek's), back in x's dtype."""
    return apply_rotary(x.float(), rope).to(x.dtype)


class DeepseekV2DecoderLayer(DecoderLayer):
    attention_class = MLAAttention  # type: ignore[assignment]


class DeepseekV2ForCausalLM(SparseMoEForCausalLM):
    gguf = GGUFFormat(GGUF_LAYER_NAMES, transformers_key="llama", config=deepseek2_gguf_config)
    decoder_layer = DeepseekV2DecoderLayer
    stacked_params = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))  # (no fused q/k/v)

    def make_decoder_config(self, config) -> DecoderConfig:
        if config.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"DeepSeek-V2 topk_method {config.topk_method!r}: greedy and group_limited_greedy are supported"
            )
        return MLAConfig(
            **asdict(super().make_decoder_config(config)),
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            softmax_scale=softmax_scale(config),
        )

    @staticmethod
    def is_sparse(config, index: int) -> bool:
        return index >= config.first_k_dense_replace

    @staticmethod
    def num_experts(config) -> int:
        return config.n_routed_experts

    @staticmethod
    def moe_options(config) -> dict:
        grouped = config.topk_method == "group_limited_greedy"
        return {
            "shared_intermediate": config.moe_intermediate_size * config.n_shared_experts,
            "shared_gate": False,
            "routed_scale": config.routed_scaling_factor,
            "groups": (config.n_group, config.topk_group) if grouped else None,
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._ours(weights))

    def _ours(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as this model's: kv_b_proj (or a GGUF file's k_b and v_b) as
        each head's W_UK (transposed) and W_UV; q_pe's and k_pe's rows in rotate-half order (a
        GGUF file's quantized rows moved whole); shared_experts as the SparseMoE's shared_expert."""
        cfg: MLAConfig = self.decoder_config  # type: ignore[assignment]
        nope, rope, rank, heads = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.num_heads
        pairs = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        q_rows = torch.arange(heads * (nope + rope)).view(heads, -1)
        q_order = torch.cat([q_rows[:, :nope], q_rows[:, nope:][:, pairs]], dim=1).flatten()
        kv_a_order = torch.cat([torch.arange(rank), rank + pairs])
        for name, tensor in weights:
            prefix, _, part = name.rpartition(".self_attn.")
            up = f"{prefix}.self_attn"
            if part == "kv_b_proj.weight":
                per_head = tensor.view(heads, nope + cfg.v_head_dim, rank)
                for h, rows in enumerate(per_head):
                    yield f"{up}.k_up.heads.{h}.weight", rows[:nope].T
                    yield f"{up}.v_up.heads.{h}.weight", rows[nope:]
            elif part in ("k_b_proj.weight", "v_b_proj.weight"):
                for h, rows in enumerate(tensor):
                    yield f"{up}.{part[0]}_up.heads.{h}.weight", rows
            elif part in ("q_proj.weight", "q_b_proj.weight"):
                yield name, _rows_in_order(tensor, q_order)
            elif part in ("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias"):
                yield name, _rows_in_order(tensor, kv_a_order)
            else:
                yield name.replace(".mlp.shared_experts.", ".mlp.shared_expert."), tensor


def _rows_in_order(tensor: torch.Tensor | GGUFTensor, order: torch.Tensor) -> torch.Tensor | GGUFTensor:
    """A weight's (or bias's) rows in `order`; a GGUF tensor's rows of blocks alike."""
    if isinstance(tensor, GGUFTensor):
        return GGUFTensor(tensor.type_name, tensor.raw[order], tensor.cols)
    return tensor[order]
