"""Online quantization of a Hugging Face checkpoint's linear layers (vLLM's --quantization):

    int8        symmetric, one scale per output channel (weight-only: activations stay as they are
                until the kernels quantize them per 32 values)
    int4        asymmetric 4-bit, a scale and a minimum per group of 128 values along a row
    int4_g32    the same with groups of 32

The checkpoint loads into plain weights as usual; once loaded, each layer is quantized and packed
for the same kernels as GGUF's (int8 as Q8_0 records, int4 as Q4_1 records), and the float copy is
freed. The embedding and the output head stay unquantized, as vLLM keeps them.
"""

from __future__ import annotations

import functools

from pagedllm.layers.linear import Linear, LinearMethodBase, UnquantizedLinearMethod
from pagedllm.layers.quantization import PackedQuantMethod, QuantizationConfig
from pagedllm.layers.quantization.formats import pack, quantize_int4_groups, quantize_int8_rows

SCHEMES = {"int8": None, "int4": 128, "int4_g32": 32}  # name -> int4 group size


class OnlineQuantConfig(QuantizationConfig):
    def __init__(self, scheme: str) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown online quantization {scheme!r}; choose from {', '.join(SCHEMES)}")
        self.scheme = scheme

    def linear_method(self, names: list[str]) -> LinearMethodBase | None:
        return None if names == ["lm_head"] else OnlineQuantLinearMethod(self.scheme)


class OnlineQuantLinearMethod(PackedQuantMethod):
    """Plain weights while loading (UnquantizedLinearMethod's), quantized and packed once loaded."""

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme

    def create_weights(self, layer: Linear, weight_loader) -> None:
        UnquantizedLinearMethod.create_weights(self, layer, weight_loader)
        if layer.input_part is not None and SCHEMES[self.scheme] is None:
            layer.weight.weight_loader = functools.partial(_load_keeping_row_max, layer, weight_loader)

    def process_weights_after_loading(self, layer: Linear) -> None:
        weight = layer.weight.detach()
        group = SCHEMES[self.scheme]
        fields = (
            quantize_int8_rows(weight, layer.__dict__.pop("_row_max", None))
            if group is None
            else quantize_int4_groups(weight, group)
        )
        del layer.weight
        self.install(layer, [(pack(fields), fields.format, layer.out_features)], (self.scheme,))


def _load_keeping_row_max(layer: Linear, weight_loader, param, loaded, shard_id=None) -> None:
    """A row-parallel layer's int8 scales are its whole rows' (max |w| over every rank's columns),
    so that each rank's codes are the ones a single rank's would be."""
    layer._row_max = loaded.to(param.dtype).float().abs().amax(dim=1)  # of the values held, as one rank's
    weight_loader(param, loaded, shard_id)
