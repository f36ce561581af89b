"""Quantized weights: which linear method each layer of a model gets.

A QuantizationConfig answers, for a layer made of some checkpoint tensors, with the linear method
that holds and applies its weights (None: unquantized). GGUF files carry their types per tensor
(quantization/gguf.py); the kernels and the block layouts are in quantization/formats.py and
kernels/quant_linear.cpp.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from pagedllm.kernels import cpu_ops
from pagedllm.layers.linear import KernelSpec, Linear, LinearMethodBase, SiluAndMulLinear
from pagedllm.layers.quantization.formats import Format


class QuantizationConfig(ABC):
    @abstractmethod
    def linear_method(self, names: list[str]) -> LinearMethodBase | None:
        """The method for a linear layer made of these checkpoint modules (their names without
        ".weight": several for a fused layer); None for unquantized weights."""

    def quantized_embedding(self, name: str) -> bool:
        """Whether the token embedding (checkpoint module `name`) is kept quantized."""
        return False

    def embedding(self, name: str, vocab_size: int, hidden_size: int) -> nn.Module | None:
        """The token embedding where the format keeps it its own way; None: a plain table."""
        return None

    def tied_head(self, embedding: nn.Module) -> nn.Module | None:
        """The output head tied to `embedding` where the format computes it its own way; None: a
        linear layer sharing the embedding's weight."""
        return None


class PackedQuantMethod(LinearMethodBase):
    """What the quantized methods share once their weights are packed: the kernels' QuantLinear
    computes the layer (SiLU-and-mul included on a SiluAndMulLinear) and is what the C++ decoder
    stack runs. A method packs its weights in process_weights_after_loading, then calls install."""

    @staticmethod
    def install(layer: Linear, segments: list[tuple[torch.Tensor, Format, int]], labels: tuple[str, ...]) -> None:
        """segments: (packed records, their format, output rows) side by side along the output;
        labels: what the start-up log says the layer runs as. Sets a buffer `packed_<i>` per
        segment, `formats` and `_op`."""
        for i, (packed, _, _) in enumerate(segments):
            layer.register_buffer(f"packed_{i}", packed, persistent=False)
        layer.formats = labels
        records = [(packed, fmt.format_id, rows) for packed, fmt, rows in segments]
        silu_mul = isinstance(layer, SiluAndMulLinear)
        layer._op = cpu_ops().QuantLinear(records, layer.in_features, layer._parameters["bias"], silu_mul)
        # A gated MLP's gate/up product without the activation (LoRA adds to it): the same records.
        layer._product_op = (
            cpu_ops().QuantLinear(records, layer.in_features, layer._parameters["bias"], False) if silu_mul else None
        )

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.reduce_results and x.dtype == torch.bfloat16 and layer._parameters["bias"] is None:
            # A row-parallel share in fp32, summed over the ranks before it is rounded (Linear.forward),
            # as one rank's sum is: the kernels quantize the same activations from fp32 (bf16 values
            # exactly); only Q5 layers' bf16 tiles (256 rows and more) are not taken so.
            return layer._op(x.float())
        return layer._op(x)

    def apply_silu_and_mul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return layer._op(x)  # built with silu_mul on a SiluAndMulLinear

    def apply_product(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return layer._product_op(x) if layer._product_op is not None else self.apply(layer, x)

    def product_kernel_spec(self, layer: Linear) -> KernelSpec | None:
        return layer._product_op

    def kernel_spec(self, layer: Linear) -> KernelSpec | None:
        return layer._op
