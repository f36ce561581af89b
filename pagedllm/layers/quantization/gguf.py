"""GGUF weights kept in their quantized blocks, computed on by the quantized kernels.

The loader reads each tensor's type from the file before the model is built (GGUFConfig); a
linear layer with quantized tensors gets a GGUFLinearMethod, which takes the raw blocks of each
of its shards as they load (fused q/k/v may mix types: a Q4_K_M file has q and k in Q4_K and v
in Q6_K), and once all are in, packs them (formats.pack) and builds the kernels' QuantLinear: one
segment per run of shards of one type. The token embedding stays quantized too
(QuantizedEmbedding: rows dequantized as they are looked up), and a tied output head computes on
the same packed table (TiedHead).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.kernels import cpu_ops
from pagedllm.layers.linear import Linear, LinearMethodBase, WeightLoader
from pagedllm.layers.quantization import PackedQuantMethod, QuantizationConfig
from pagedllm.layers.quantization.formats import FORMATS, decode, dequantize, pack

FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass
class GGUFTensor:
    """A tensor as the file stores it: raw blocks of its type, a row of bytes per output row."""

    type_name: str
    raw: torch.Tensor  # uint8 [rows, bytes a row]
    cols: int

    @property
    def rows(self) -> int:
        return self.raw.shape[0]


class GGUFConfig(QuantizationConfig):
    """Per tensor (by its Hugging Face name), the file's type."""

    def __init__(self, tensor_types: dict[str, str]) -> None:
        self.tensor_types = tensor_types
        for name, type_name in tensor_types.items():
            if type_name not in FORMATS and type_name not in FLOAT_TYPES:
                raise ValueError(
                    f"GGUF tensor {name} is of type {type_name}, which pagedllm cannot compute on; "
                    f"supported: {', '.join([*FLOAT_TYPES, *FORMATS])}"
                )

    def _types(self, names: list[str]) -> list[str]:
        return [self.tensor_types.get(f"{name}.weight", "F32") for name in names]

    def linear_method(self, names: list[str]) -> LinearMethodBase | None:
        types = self._types(names)
        quantized = [t in FORMATS for t in types]
        if not any(quantized):
            return None
        if not all(quantized):
            raise ValueError(
                f"GGUF tensors {', '.join(f'{n} ({t})' for n, t in zip(names, types))} form one layer "
                "but mix quantized and float types, which pagedllm does not combine"
            )
        return GGUFLinearMethod()

    def quantized_embedding(self, name: str) -> bool:
        return self._types([name])[0] in FORMATS

    def embedding(self, name: str, vocab_size: int, hidden_size: int) -> nn.Module | None:
        return QuantizedEmbedding(vocab_size, hidden_size) if self.quantized_embedding(name) else None

    def tied_head(self, embedding: nn.Module) -> nn.Module | None:
        return TiedHead(embedding) if isinstance(embedding, QuantizedEmbedding) else None


def _stash(layer: Linear, param: nn.Parameter, loaded: GGUFTensor, shard_id: str | int | None = None) -> None:
    """A shard's raw blocks, kept until every shard of the layer is in: under tensor parallelism,
    this rank's rows of it (column-parallel) or its columns, whole blocks of them (row-parallel)."""
    if not isinstance(loaded, GGUFTensor):
        raise ValueError(f"quantized blocks expected, got a {type(loaded).__name__}")
    whole = layer.whole_rows(shard_id)
    if (loaded.rows, loaded.cols) != (whole, layer.input_whole):
        raise ValueError(f"checkpoint shape {(loaded.rows, loaded.cols)}, model expects {(whole, layer.input_whole)}")
    if layer.input_part is not None:
        loaded = columns_in_blocks(loaded, *layer.input_part)
    for local, source, rows in layer.rows_of(shard_id):
        layer._gguf_shards[local] = GGUFTensor(loaded.type_name, loaded.raw.narrow(0, source, rows), loaded.cols)


def columns_in_blocks(tensor: GGUFTensor, start: int, count: int) -> GGUFTensor:
    """Input columns start .. start + count of every row, which must fall on the type's blocks."""
    fmt = FORMATS[tensor.type_name]
    if start % fmt.block_values or count % fmt.block_values:
        raise ValueError(
            f"this rank's input columns {start}..{start + count} do not fall on whole {fmt.name} blocks "
            f"of {fmt.block_values} values: choose a --tensor-parallel-size whose shares do, or "
            "--quantization none"
        )
    first, nbytes = start // fmt.block_values * fmt.block_bytes, count // fmt.block_values * fmt.block_bytes
    return GGUFTensor(tensor.type_name, tensor.raw.narrow(1, first, nbytes).contiguous(), count)


def dequantized(tensor: GGUFTensor) -> torch.Tensor:
    """A tensor's blocks as float32 [rows, cols] (a tensor-parallel embedding holds its rows so)."""
    return dequantize(decode(tensor.raw.numpy(), FORMATS[tensor.type_name]))


class GGUFLinearMethod(PackedQuantMethod):
    """Weights in the file's blocks, packed for kernels/quant_linear.cpp. While loading, a layer
    keeps each shard's raw blocks in `_gguf_shards` (first row -> shard); then one segment per run
    of shards of one type."""

    def create_weights(self, layer: Linear, weight_loader: WeightLoader) -> None:
        # The blocks' size is the file's business: a placeholder takes each shard as it loads.
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.weight.weight_loader = functools.partial(_stash, layer)
        layer._gguf_shards = {}

    def process_weights_after_loading(self, layer: Linear) -> None:
        shards = [shard for _, shard in sorted(layer._gguf_shards.items())]
        covered = sum(shard.rows for shard in shards)
        if covered != layer.out_features:
            raise ValueError(f"quantized layer of {layer.out_features} rows got {covered} rows of weights")
        segments = []
        for run in _runs(shards):
            fmt = FORMATS[run[0].type_name]
            raw = run[0].raw if len(run) == 1 else torch.cat([s.raw for s in run])
            segments.append((pack(decode(raw.numpy(), fmt)), fmt, raw.shape[0]))
        del layer._gguf_shards, layer.weight
        self.install(layer, segments, tuple(fmt.name for _, fmt, _ in segments))


def _runs(shards: list[GGUFTensor]) -> list[list[GGUFTensor]]:
    """Consecutive shards of one type, together."""
    runs: list[list[GGUFTensor]] = []
    for shard in shards:
        if runs and runs[-1][0].type_name == shard.type_name:
            runs[-1].append(shard)
        else:
            runs.append([shard])
    return runs


class QuantizedEmbedding(Linear):
    """The token embedding kept quantized: a [vocab, hidden] matrix held as a linear layer's
    (so that a tied head computes on it: project), its rows dequantized as tokens look them up."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(embedding_dim, num_embeddings, bias=False, method=GGUFLinearMethod())
        self.embedding_dim = embedding_dim
        # Empty: it only carries the model's dtype (set by .to(dtype)), the rows' dtype.
        self.register_buffer("activation_dtype", torch.empty(0), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(ids.numel(), self.embedding_dim, dtype=self.activation_dtype.dtype, device=ids.device)
        cpu_ops().quant_embedding(out, ids.reshape(-1).long(), self.packed_0, FORMATS[self.formats[0]].format_id)
        return out.view(*ids.shape, self.embedding_dim)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class TiedHead(nn.Module):
    """An output head that is the (quantized) embedding matrix itself."""

    def __init__(self, embedding: QuantizedEmbedding) -> None:
        super().__init__()
        self._embedding = [embedding]  # not a submodule: the embedding is registered where it lives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._embedding[0].project(x)


def gguf_tensor(raw: np.ndarray, type_name: str, cols: int) -> GGUFTensor:
    """A tensor's blocks copied out of the file's mapping (so that the mapping can be dropped)."""
    return GGUFTensor(type_name, torch.from_numpy(np.array(raw, dtype=np.uint8)), cols)
