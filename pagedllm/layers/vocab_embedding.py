"""The token embedding as the weight format and tensor parallelism keep it."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import all_reduce, tensor_parallel
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.quantization.gguf import GGUFTensor, dequantized


def token_embedding(quant: QuantizationConfig | None, name: str, vocab_size: int, hidden_size: int) -> nn.Module:
    """The embedding of checkpoint module `name`: this rank's rows under tensor parallelism, else
    the format's own (QuantizationConfig.embedding: GGUF keeps it quantized), else a plain table."""
    if tensor_parallel().size > 1:
        return VocabParallelEmbedding(vocab_size, hidden_size)
    own = quant.embedding(name, vocab_size, hidden_size) if quant is not None else None
    return own if own is not None else nn.Embedding(vocab_size, hidden_size)


class VocabParallelEmbedding(nn.Embedding):
    """Tensor parallelism's embedding: this rank's share of the vocabulary's rows; a token another
    rank holds looks up zeros here, and the ranks' lookups are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        self.vocab_start, rows = tensor_parallel().split(num_embeddings)
        super().__init__(rows, embedding_dim)
        self.vocab_size = num_embeddings
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor | GGUFTensor) -> None:
        whole = (self.vocab_size, *param.shape[1:])
        shape = (loaded.rows, loaded.cols) if isinstance(loaded, GGUFTensor) else tuple(loaded.shape)
        if shape != whole:
            raise ValueError(f"checkpoint shape {shape}, model expects {whole}")
        if isinstance(loaded, GGUFTensor):  # a GGUF file's quantized table: this rank's rows, dequantized
            param.data.copy_(
                dequantized(
                    GGUFTensor(loaded.type_name, loaded.raw.narrow(0, self.vocab_start, param.shape[0]), loaded.cols)
                )
            )
            return
        param.data.copy_(loaded.narrow(0, self.vocab_start, param.shape[0]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.num_embeddings)
        out = super().forward(torch.where(held, local, 0))
        return all_reduce(out.masked_fill_(~held.unsqueeze(-1), 0))
