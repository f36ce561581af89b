"""Quantized Hugging Face checkpoints written by the formats' own packages, and those packages'
dequantization, the oracles of tests/test_hf_quantized.py:

    AWQ                 autoawq's WQLinear_GEMM.from_linear packs, its dequantize_gemm unpacks
    GPTQ                AutoGPTQ's QuantLinear.pack packs (v1 format, g_idx for act-order), its
                        torch forward (on an identity) dequantizes
    compressed-tensors  its compressors quantize, pack and decompress

autoawq and AutoGPTQ are installed without their dependencies (Makefile): their package
__init__s import what is not installed (datasets) or gone from transformers 5, so their modules
are imported below a bare package. The quantizers' scales and zeros are min-max ones, computed
here: the packages' calibration searches (AWQ's scale search, GPTQ's Hessian updates) choose
other values but write them in the same layout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import types

import torch
from safetensors.torch import load_file, save_file
from torch import nn

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _bare_package(name: str) -> None:
    """`name` importable as a package without running its __init__."""
    if name not in sys.modules:
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise ImportError(f"{name} is not installed (make install installs it)")
        package = types.ModuleType(name)
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules[name] = package


def min_max(w: torch.Tensor, group_of: torch.Tensor, groups: int, bits: int, symmetric: bool):
    """Per row and group: float16 scales and integer zeros [rows, groups] as GPTQ's and AWQ's
    quantizers compute them from the group's range, and the weights moved onto that grid (what a
    quantizer's output dequantizes to), so that packing recovers the codes exactly."""
    top = 2**bits - 1
    rows = w.shape[0]
    lo = torch.zeros(rows, groups).scatter_reduce(1, group_of.expand(rows, -1), w, "amin", include_self=False)
    hi = torch.zeros(rows, groups).scatter_reduce(1, group_of.expand(rows, -1), w, "amax", include_self=False)
    if symmetric:
        hi = torch.maximum(hi.abs(), lo.abs())
        lo = -hi
    scales = ((hi - lo).clamp(min=1e-5) / top).half().float()
    zeros = torch.full_like(scales, (top + 1) // 2) if symmetric else (-torch.round(lo / scales)).clamp(0, top)
    s, z = scales[:, group_of], zeros[:, group_of]
    q = (torch.round(w / s) + z).clamp(0, top)
    return scales, zeros.int(), (q - z) * s


def _linear(w: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(w.shape[1], w.shape[0], bias=False)
    layer.weight.data = w.clone()
    return layer


# -- per format: (checkpoint tensors of one layer, the oracle's dequantized weight [out, in]) ------
def awq(w: torch.Tensor, group: int = 128) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    _bare_package("awq")
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    group_of = torch.arange(w.shape[1]) // group
    scales, zeros, on_grid = min_max(w, group_of, w.shape[1] // group, 4, symmetric=False)
    packed = WQLinear_GEMM.from_linear(
        _linear(on_grid), 4, group, scales=scales.T.contiguous(), zeros=zeros.T.contiguous()
    )
    tensors = {"qweight": packed.qweight, "qzeros": packed.qzeros, "scales": packed.scales}
    oracle = dequantize_gemm(packed.qweight, packed.qzeros, packed.scales.float(), 4, group).T
    return tensors, oracle.contiguous()


def gptq(w: torch.Tensor, bits: int, sym: bool, act_order: bool, group: int = 128, seed: int = 0):
    _bare_package("auto_gptq")
    from auto_gptq.nn_modules.qlinear.qlinear_cuda import QuantLinear

    cols = w.shape[1]
    if act_order:  # columns quantized in an order of their own (GPTQ's by Hessian diagonal): g_idx
        order = torch.randperm(cols, generator=torch.Generator().manual_seed(seed))
        group_of = torch.empty(cols, dtype=torch.long)
        group_of[order] = torch.arange(cols) // group
    else:
        group_of = torch.arange(cols) // group
    scales, zeros, on_grid = min_max(w, group_of, cols // group, bits, sym)
    layer = QuantLinear(bits, group, cols, w.shape[0], bias=False)
    layer.pack(_linear(on_grid), scales, zeros.clone(), g_idx=group_of.int())
    tensors = {
        "qweight": layer.qweight,
        "qzeros": layer.qzeros,
        "scales": layer.scales.half(),
        "g_idx": layer.g_idx.int(),
    }
    layer.scales = layer.scales.float()  # its forward then dequantizes in float32, exactly
    with torch.no_grad():
        oracle = layer(torch.eye(cols)).T
    return tensors, oracle.contiguous()


def compressed_scheme(bits: int, symmetric: bool, strategy: str, group: int | None, activations: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    inputs = (
        QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        if activations
        else None
    )
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)


def compressed(w: torch.Tensor, scheme) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from compressed_tensors.compressors import NaiveQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    rows, cols = w.shape
    span = args.group_size if args.strategy == "group" else cols
    grouped = w.view(rows, cols // span, span)
    scale, zero = calculate_qparams(grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0), args)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
    compressor = PackedQuantizationCompressor if args.num_bits == 4 else NaiveQuantizationCompressor
    tensors = compressor.compress(state, scheme)
    oracle = compressor.decompress(dict(tensors), scheme)["weight"].float()
    return tensors, oracle


def compressed_config(scheme, form: str) -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={"group_0": scheme}, format=form, ignore=["lm_head"])
    return {**config.to_dict(), "quant_method": "compressed-tensors"}


# -- whole checkpoints --------------------------------------------------------------------------------
def quantize_folder(source: str, quantized: str, dequantized: str, quantize, quantization_config: dict) -> None:
    """From the float folder `source`: `quantized`, its decoder layers' linear weights replaced by
    `quantize(weight)`'s checkpoint tensors, and `dequantized`, a float folder of the oracle's
    dequantization of them (the reference the quantized model is held to)."""
    weights = load_file(os.path.join(source, "model.safetensors"))
    packed, plain = {}, {}
    for name, tensor in weights.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            tensors, oracle = quantize(tensor.float())
            packed.update({f"{module}.{key}": value.contiguous() for key, value in tensors.items()})
            plain[name] = oracle.to(tensor.dtype)
        else:
            packed[name] = plain[name] = tensor
    for folder, contents in ((quantized, packed), (dequantized, plain)):
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(contents, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(quantized, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(quantized, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
