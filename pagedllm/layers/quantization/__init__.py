"""Quantized weights: which linear method each layer of a model gets.

A QuantizationConfig answers, for a layer made of some checkpoint tensors, with the linear method
that holds and applies its weights (None: unquantized). GGUF files carry their types per tensor
(quantization/gguf.py); the kernels and the block layouts are in quantization/formats.py and
kernels/quant_linear.cpp.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.layers.linear import LinearMethodBase


class QuantizationConfig(ABC):
    @abstractmethod
    def linear_method(self, names: list[str]) -> LinearMethodBase | None:
        """The method for a linear layer made of these checkpoint modules (their names without
        ".weight": several for a fused layer); None for unquantized weights."""

    def quantized_embedding(self, name: str) -> bool:
        """Whether the token embedding (checkpoint module `name`) is kept quantized."""
        return False
