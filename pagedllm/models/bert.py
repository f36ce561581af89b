"""BERT encoders (all-MiniLM-L6-v2 and the other sentence-transformers BERTs): embeddings of words,
absolute positions and token types (0, or 1 for a pair's second text), then post-norm layers of
bidirectional attention and a GELU MLP. An encoder only pools: each prompt attends to all of
itself, so it is computed in one step, with no KV cache (the scheduler still counts its blocks,
which the runner never allocates). BertForSequenceClassification (cross-encoders such as the
ms-marco MiniLM rerankers) adds BERT's pooler (a tanh dense layer over [CLS]) and a classifier."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import PoolerConfig
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.linear import Linear, QKVLinear, load_weight
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.decoder import linear_method
from pagedllm.models.interface import KVCache, Model

logger = logging.getLogger(__name__)

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# Checkpoint tensors an encoder that embeds has no use for: BERT's own pooler (a dense layer over
# [CLS], sentence-transformers pools without it), masked-LM heads, and a buffer of position ids.
_UNUSED = ("pooler.", "cls.", "embeddings.position_ids")


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Type 0 unless the step gives types (a pair's second text is type 1).
        types = self.token_type_embeddings.weight[0] if token_types is None else self.token_type_embeddings(token_types)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + types
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv = QKVLinear(
            config.hidden_size,
            config.hidden_size,
            config.hidden_size,
            True,
            linear_method(quant, prefix, "query", "key", "value"),
        )

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Each sequence of the step attends to all of itself (no mask inside it, nothing across)."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        out = torch.empty_like(q)
        start = 0
        for length in meta.query_lens_list:
            span = slice(start, start + length)
            heads = [t[span].transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, L, D]
            out[span] = F.scaled_dot_product_attention(*heads)[0].transpose(0, 1)
            start += length
        return out.view(x.shape[0], -1)


class BertDenseNorm(nn.Module):
    """A sublayer's output: LayerNorm(residual + dense(x)) (BERT's post-norm)."""

    def __init__(self, in_features: int, config, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.dense = Linear(in_features, config.hidden_size, True, linear_method(quant, prefix, "dense"))
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, quant, f"{prefix}.self")
        self.output = BertDenseNorm(config.hidden_size, config, quant, f"{prefix}.output")

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.output(self.self(x, meta), x)


class BertIntermediate(nn.Module):
    def __init__(self, config, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size, True, linear_method(quant, prefix, "dense"))
        self.activation = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.attention = BertAttention(config, quant, f"{prefix}.attention")
        self.intermediate = BertIntermediate(config, quant, f"{prefix}.intermediate")
        self.output = BertDenseNorm(config.intermediate_size, config, quant, f"{prefix}.output")

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.attention(x, meta)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config, quant: QuantizationConfig | None) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            BertLayer(config, quant, f"encoder.layer.{i}") for i in range(config.num_hidden_layers)
        )


class BertModel(Model):
    """The encoder; its output is the last layer's hidden states, which the pooler reduces (mean for
    sentence-transformers' MiniLM models, as their folder says; [CLS] where none does)."""

    is_causal = False
    default_pooler = PoolerConfig("CLS", normalize=True)
    # The checkpoint's q, k and v -> our fused layer's shards.
    _qkv_shards = {"query": "q", "key": "k", "value": "v"}
    _head_params: tuple[str, ...] = ()  # a subclass's head, loaded by it

    def __init__(self, config, max_positions: int, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"BERT with {config.position_embedding_type!r} positions is not supported (absolute only)")
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"BERT activation {config.hidden_act!r} is not supported; known: {', '.join(_ACTIVATIONS)}"
            )
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config, quant_config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, attn_metadata.token_types)
        for layer in self.encoder.layer:
            x = layer(x, attn_metadata)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a BERT encoder embeds; it has no language-model head")

    def bind_kernels(self) -> None:
        logger.info("BertModel runs op by op (its linear layers through their methods)")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = {n: p for n, p in self.named_parameters() if not n.startswith(self._head_params)}
        missing = {(name, shard) for name in params for shard in (("q", "k", "v") if ".qkv." in name else (None,))}
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(_UNUSED):
                continue
            target, shard = self._target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in BertModel")
            load_weight(params[target], tensor, shard, name)
            missing.discard((target, shard))
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {sorted(n for n, _ in missing)[:5]}")

    def _target(self, name: str) -> tuple[str, str | None]:
        """A checkpoint name -> (our parameter's name, the q/k/v shard it fills or None)."""
        parts = name.split(".")
        if len(parts) >= 3 and parts[-3] == "self" and parts[-2] in self._qkv_shards:
            return ".".join(parts[:-2] + ["qkv", parts[-1]]), self._qkv_shards[parts[-2]]
        return name, None


class BertForSequenceClassification(BertModel):
    """A cross-encoder: the encoder, [CLS] through BERT's pooler (dense, tanh) and a classifier to
    num_labels logits (`classify`); a pair's relevance is the activation of its one logit
    (sentence-transformers' CrossEncoder: a sigmoid, or what its config names)."""

    default_pooler = PoolerConfig("CLS", normalize=False)
    pooling_tasks = ("classify", "score")
    _head_params = ("pooler.", "classifier.")

    def __init__(self, config, max_positions: int, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, max_positions, quant_config)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[CLS]'s hidden state -> the labels' logits (fp32)."""
        head = self.classifier.weight
        return self.classifier(torch.tanh(self.pooler(pooled.to(head.dtype)))).float()

    def score_activation(self, logits: torch.Tensor) -> torch.Tensor:
        """What a pair's score is made of its logits: CrossEncoder's activation (sigmoid by
        default for one label; Identity where the folder's config says so)."""
        named = (getattr(self.config, "sentence_transformers", None) or {}).get("activation_fn", "")
        if named.endswith("Identity"):
            return logits
        return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        head: dict[str, torch.Tensor] = {}
        body = []
        for name, tensor in weights:
            short = name.removeprefix("bert.")
            if short.startswith(("pooler.dense.", "classifier.")):
                head[short.replace("pooler.dense.", "pooler.")] = tensor
            else:
                body.append((name, tensor))
        super().load_weights(body)
        for name, param in (*self.pooler.named_parameters(prefix="pooler"),
                            *self.classifier.named_parameters(prefix="classifier")):  # fmt: skip
            if name not in head:
                raise ValueError(f"checkpoint lacks tensors for: {name}")
            with torch.no_grad():
                param.copy_(head[name].to(param.dtype))
