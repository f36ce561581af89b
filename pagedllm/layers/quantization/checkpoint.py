"""Hugging Face checkpoints that are quantized already: AWQ, GPTQ and compressed-tensors, their
`quantization_config` in config.json. Their integer weights are repacked at load onto the GGUF
kernels' records (formats.py), as their layouts allow:

| checkpoint | weight | runs as |
|---|---|---|
| GPTQ 4-bit symmetric, compressed-tensors int4 symmetric (W4A16) | s (u - 8) | Q4_0, exactly |
| GPTQ 8-bit symmetric, compressed-tensors int8 (W8A16, W8A8) | s (u - 128) | Q8_0, exactly |
| AWQ (GEMM), GPTQ 4-bit asymmetric, compressed-tensors int4 asymmetric | s (u - z) | Q4_1: d = s, m = -z s in float16 |

A group's scale (and zero) is repeated over its blocks of 32 values, so a group must be whole
blocks (AWQ's and GPTQ's usual 128 are four; per-channel scales, a whole row). Scales stored in
bfloat16 or float32 are rounded to float16, the records' type. Activations are quantized to int8
per 32 values as for every record (a W8A8 checkpoint's per-token scales are not used). GPTQ's
activation order (desc_act: each input column's group in g_idx) sorts the input columns by group,
so that each group's columns are contiguous, and each step's activations are gathered into that
order before the layer; such layers run op by op (the C++ stack takes no permutation).

While loading, a layer holds placeholders named as the checkpoint's tensors (qweight, qzeros,
scales, g_idx; weight_packed, weight_scale, ...), which keep each shard's tensors as they come;
once all are in, each shard is unpacked (`unpack_*`: codes, scales, zeros, g_idx as a
`GroupQuant`), this rank's rows and columns taken, and the shards packed side by side.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from pagedllm.layers.linear import KernelSpec, Linear, LinearMethodBase, WeightLoader
from pagedllm.layers.quantization import PackedQuantMethod, QuantizationConfig
from pagedllm.layers.quantization.formats import BLOCK, FORMATS, Fields, pack

METHODS = ("awq", "gptq", "compressed-tensors")  # quant_method, as config.json and vLLM's --quantization name them
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's GEMM layout: nibble i of a word holds column 8c + AWQ_ORDER[i]


@dataclass
class GroupQuant:
    """A weight matrix as these checkpoints quantize it, unpacked: w = s (u - z) per group of
    input columns, u unsigned. `zeros` None: symmetric, z = 2^(bits - 1)."""

    bits: int
    codes: torch.Tensor  # uint8 [rows, cols]
    scales: torch.Tensor  # float [rows, groups]
    zeros: torch.Tensor | None  # int16 [rows, groups]
    group_of: torch.Tensor  # int64 [cols]: each input column's group (GPTQ's g_idx; else column // group)

    def rows(self, start: int, count: int) -> GroupQuant:
        zeros = None if self.zeros is None else self.zeros.narrow(0, start, count)
        return replace(
            self, codes=self.codes.narrow(0, start, count), scales=self.scales.narrow(0, start, count), zeros=zeros
        )

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]: the checkpoint's own weights, the reference the records are held to."""
        zero = 2 ** (self.bits - 1) if self.zeros is None else self.zeros[:, self.group_of].float()
        return self.scales.float()[:, self.group_of] * (self.codes.float() - zero)


def in_groups(group_size: int, cols: int) -> torch.Tensor:
    """Each column's group for contiguous groups of `group_size` (-1: the whole row, one group)."""
    return torch.arange(cols) // (cols if group_size in (-1, None) else group_size)


# -- the checkpoints' packings -> GroupQuant ------------------------------------------------------
def _nibbles_of(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [.., n] -> uint8 [.., n, 32 / bits]: each word's fields from its lowest bits up."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((words.to(torch.int32)[..., None] >> shifts) & (2**bits - 1)).to(torch.uint8)


def _along_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[n / per, cols] words packing `n` values along dim 0, lowest bits first -> [n, cols]."""
    values = _nibbles_of(words, bits)  # [n / per, cols, per]
    return values.permute(0, 2, 1).reshape(-1, words.shape[1])


def _along_cols(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, n / per] words packing along dim 1, lowest bits first -> [rows, n]."""
    return _nibbles_of(words, bits).reshape(words.shape[0], -1)


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ's [k, n / 8] words -> [k, n]: nibble i of word c is column 8c + AWQ_ORDER[i]."""
    values = _nibbles_of(words, 4)  # [k, n / 8, 8]
    out = torch.empty_like(values)
    out[..., list(AWQ_ORDER)] = values
    return out.reshape(words.shape[0], -1)


def unpack_awq(tensors: dict[str, torch.Tensor], group_size: int) -> GroupQuant:
    """qweight int32 [in, out / 8], qzeros int32 [in / group, out / 8], scales float16 [in / group, out]."""
    codes = _awq_columns(tensors["qweight"]).T.contiguous()
    zeros = _awq_columns(tensors["qzeros"]).T.to(torch.int16)
    return GroupQuant(4, codes, tensors["scales"].T.contiguous(), zeros, in_groups(group_size, codes.shape[1]))


def unpack_gptq(tensors: dict[str, torch.Tensor], bits: int, v1: bool) -> GroupQuant:
    """qweight int32 [in * bits / 32, out] (packed along the input), qzeros int32 [groups, out * bits
    / 32], scales float16 [groups, out], g_idx int32 [in]. The v1 format ("gptq", AutoGPTQ's) stores
    each zero less one: z = stored + 1 (a zero of 0 then reads as 2^bits, as AutoGPTQ's own kernels
    read it); gptq_v2 stores z."""
    codes = _along_rows(tensors["qweight"], bits).T.contiguous()
    zeros = _along_cols(tensors["qzeros"], bits).T.to(torch.int16) + int(v1)
    return GroupQuant(bits, codes, tensors["scales"].T.contiguous(), zeros, tensors["g_idx"].long())


def unpack_compressed(tensors: dict[str, torch.Tensor], bits: int, group_size: int | None) -> GroupQuant:
    """compressed-tensors: pack-quantized's weight_packed int32 [out, in * bits / 32] (values from
    the lowest bits, each stored plus 2^(bits - 1)), with weight_shape, or int-/naive-quantized's int8
    weight [out, in]; weight_scale [out, groups] (group), [out, 1] (channel) or [1] (tensor);
    weight_zero_point (asymmetric) packed along the output, weight_g_idx (activation order)."""
    if "weight_packed" in tensors:
        rows, cols = (int(v) for v in tensors["weight_shape"])
        codes = _along_cols(tensors["weight_packed"], bits)[:, :cols].contiguous()
    else:
        rows, cols = tensors["weight"].shape
        codes = (tensors["weight"].to(torch.int16) + 2 ** (bits - 1)).to(torch.uint8)
    scales = tensors["weight_scale"].reshape(
        -1, tensors["weight_scale"].shape[-1] if tensors["weight_scale"].dim() > 1 else 1
    )
    scales = scales.expand(rows, -1) if scales.shape[0] == 1 else scales
    zeros = None
    if "weight_zero_point" in tensors:
        zeros = _along_rows(tensors["weight_zero_point"], bits)[:rows].to(torch.int16)
    group_of = tensors["weight_g_idx"].long() if "weight_g_idx" in tensors else in_groups(group_size or -1, cols)
    return GroupQuant(bits, codes.reshape(rows, cols), scales, zeros, group_of)


# -- GroupQuant -> the kernels' records --------------------------------------------------------
def to_fields(quant: GroupQuant) -> tuple[Fields, torch.Tensor | None]:
    """The records' fields for these weights, and the input permutation they need (None: none):
    activation order sorts the input columns by group, each group then whole blocks of 32."""
    group_of, codes, perm = quant.group_of, quant.codes, None
    if not torch.equal(group_of, group_of.sort(stable=True).values):
        perm = torch.argsort(group_of, stable=True)
        group_of, codes = group_of[perm], codes[:, perm]
    rows, cols = codes.shape
    if cols % BLOCK:
        raise ValueError(f"rows of {cols} input values are not whole blocks of {BLOCK}")
    starts = group_of[::BLOCK]
    if not torch.equal(group_of.view(-1, BLOCK), starts[:, None].expand(-1, BLOCK)):
        raise ValueError(
            f"quantization groups that are not whole blocks of {BLOCK} input values, which the "
            "kernels' records need (group sizes of 32, 64, 128, ... or per channel)"
        )
    scale = quant.scales.float()[:, starts].to(torch.float16)
    symmetric = quant.zeros is None or bool((quant.zeros == 2 ** (quant.bits - 1)).all())
    if symmetric:
        name = {4: "Q4_0", 8: "Q8_0"}[quant.bits]
        return Fields(FORMATS[name], codes.numpy(), scale.numpy()), perm
    if quant.bits != 4:
        raise ValueError(f"asymmetric {quant.bits}-bit weights (with zero points), which pagedllm cannot compute on")
    minimum = (-quant.zeros[:, starts].float() * scale.float()).to(torch.float16)
    return Fields(FORMATS["Q4_1"], codes.numpy(), scale.numpy(), minimum.numpy()), perm


# -- the configs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scheme:
    """What one quantized layer's checkpoint tensors are: their names, and how to unpack them."""

    label: str  # the start-up log's name for it: "GPTQ-int4", "AWQ-int4", "W8A8-int8"
    tensors: tuple[str, ...]  # a quantized module's tensors (without its name)
    unpack: functools.partial
    act_order: bool = False  # each input column's group stored (g_idx): the layers may permute their inputs


class CheckpointQuantConfig(QuantizationConfig):
    """A checkpoint's quantization_config: which layers are quantized (lm_head and the embedding
    never: only what the checkpoint's method names), and how."""

    def __init__(self, scheme: Scheme, skipped: tuple[str, ...] = (), targets: tuple[str, ...] = ()) -> None:
        self.scheme, self.skipped, self.targets = scheme, skipped, targets

    def _quantized(self, name: str) -> bool:
        if name == "lm_head" or any(_matches(pattern, name) for pattern in self.skipped):
            return False
        return not self.targets or any(_matches(pattern, name) for pattern in self.targets)

    def linear_method(self, names: list[str]) -> LinearMethodBase | None:
        quantized = [self._quantized(name) for name in names]
        if not any(quantized):
            return None
        if not all(quantized):
            raise ValueError(f"{', '.join(names)} form one layer, but the checkpoint quantizes only some of them")
        return CheckpointLinearMethod(self.scheme)


def _matches(pattern: str, name: str) -> bool:
    """compressed-tensors' targets and ignore entries ("re:" a regular expression, "Linear" every
    linear layer, else a module's name or its last part); AWQ's modules_to_not_convert (parts of names)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == "Linear" or name == pattern or name.endswith("." + pattern) or f".{pattern}." in f".{name}."


def checkpoint_quant_config(spec: dict) -> CheckpointQuantConfig:
    """The config for config.json's quantization_config; a ValueError naming what is not supported."""
    method = spec.get("quant_method")
    if method == "awq":
        return _awq_config(spec)
    if method == "gptq":
        return _gptq_config(spec)
    if method == "compressed-tensors":
        return _compressed_config(spec)
    raise ValueError(
        f"this checkpoint is quantized by {method!r}, which pagedllm does not load; it loads "
        f"{', '.join(METHODS)} checkpoints and GGUF files"
    )


def _refuse(method: str, field: str, value, supported: str) -> None:
    raise ValueError(f"{method} checkpoint with {field} {value!r}, which pagedllm does not load ({supported})")


def _group_size(method: str, value) -> int:
    group = -1 if value is None else int(value)
    if group != -1 and (group <= 0 or group % BLOCK):
        _refuse(method, "group_size", value, f"multiples of {BLOCK}, or -1: per channel")
    return group


def _awq_config(spec: dict) -> CheckpointQuantConfig:
    version = str(spec.get("version", "gemm")).lower()
    if version != "gemm":
        _refuse("AWQ", "version", version, "the GEMM layout")
    if spec.get("bits", spec.get("w_bit", 4)) != 4:
        _refuse("AWQ", "bits", spec.get("bits", spec.get("w_bit")), "4")
    if not spec.get("zero_point", True):
        _refuse("AWQ", "zero_point", False, "zero points, AWQ's default")
    group = _group_size("AWQ", spec.get("group_size", spec.get("q_group_size", 128)))
    scheme = Scheme("AWQ-int4", ("qweight", "qzeros", "scales"), functools.partial(unpack_awq, group_size=group))
    return CheckpointQuantConfig(scheme, tuple(spec.get("modules_to_not_convert") or ()))


def _gptq_config(spec: dict) -> CheckpointQuantConfig:
    bits = spec.get("bits", 4)
    if bits not in (4, 8):
        _refuse("GPTQ", "bits", bits, "4 or 8")
    form = spec.get("checkpoint_format", "gptq")
    if form not in ("gptq", "gptq_v2"):
        _refuse("GPTQ", "checkpoint_format", form, "gptq or gptq_v2")
    _group_size("GPTQ", spec.get("group_size", 128))
    if spec.get("dynamic"):
        _refuse("GPTQ", "dynamic", "per-module overrides", "one scheme for every layer")
    act_order = bool(spec.get("desc_act"))
    label = f"GPTQ-int{bits}" + ("-act-order" if act_order else "")
    unpack = functools.partial(unpack_gptq, bits=bits, v1=form == "gptq")
    scheme = Scheme(label, ("qweight", "qzeros", "scales", "g_idx"), unpack, act_order)
    return CheckpointQuantConfig(scheme, tuple(spec.get("modules_to_not_convert") or ()))


def _compressed_config(spec: dict) -> CheckpointQuantConfig:
    groups = spec.get("config_groups") or {}
    if len(groups) != 1:
        _refuse("compressed-tensors", "config_groups", sorted(groups), "one group: one scheme for every layer")
    (group,) = groups.values()
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    form = group.get("format") or spec.get("format")
    if form not in ("pack-quantized", "int-quantized", "naive-quantized"):
        _refuse("compressed-tensors", "format", form, "pack-quantized, int-quantized, naive-quantized")
    if weights.get("type", "int") != "int" or weights.get("num_bits") not in (4, 8):
        _refuse("compressed-tensors", "weights", f"{weights.get('type')}{weights.get('num_bits')}", "int4 or int8")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel", "tensor"):
        _refuse("compressed-tensors", "weights' strategy", strategy, "group, channel or tensor")
    if weights.get("dynamic"):
        _refuse("compressed-tensors", "weights' dynamic", True, "static weights")
    if inputs is not None and (
        inputs.get("type", "int") != "int" or inputs.get("num_bits") != 8 or not inputs.get("dynamic")
    ):
        _refuse("compressed-tensors", "input_activations", inputs, "none, or dynamic int8")
    if group.get("output_activations") or spec.get("kv_cache_scheme") or spec.get("sparsity_config"):
        _refuse("compressed-tensors", "output/KV cache quantization or sparsity", "set", "weights and inputs")
    bits, symmetric = weights["num_bits"], weights.get("symmetric", True)
    size = _group_size("compressed-tensors", weights.get("group_size")) if strategy == "group" else -1
    names = ("weight_packed", "weight_shape") if form == "pack-quantized" else ("weight",)
    names += ("weight_scale",) + (() if symmetric else ("weight_zero_point",))
    names += ("weight_g_idx",) if weights.get("actorder") == "group" else ()
    label = f"W{bits}A{16 if inputs is None else 8}-int{bits}"
    unpack = functools.partial(unpack_compressed, bits=bits, group_size=size)
    scheme = Scheme(label, names, unpack, "weight_g_idx" in names)
    return CheckpointQuantConfig(scheme, tuple(spec.get("ignore") or ()), tuple(group.get("targets") or ("Linear",)))


# -- the linear method ------------------------------------------------------------------------------
class CheckpointLinearMethod(PackedQuantMethod):
    """A layer's checkpoint tensors kept per shard as they load (`_checkpoint`: (tensor, shard) ->
    tensor); then unpacked, this rank's share taken, repacked into records (one segment) and
    installed, with `_perm`: the input columns' order the records need (None: as they come)."""

    def __init__(self, scheme: Scheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: Linear, weight_loader: WeightLoader) -> None:
        for name in self.scheme.tensors:
            placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            placeholder.weight_loader = functools.partial(_keep, layer, name)
            layer.register_parameter(name, placeholder)
        layer._checkpoint = {}
        layer._perm = None

    def process_weights_after_loading(self, layer: Linear) -> None:
        pieces, perms = [], []
        # Per shard, or once for a layer whose checkpoint tensors are fused already (Phi-3's qkv_proj).
        sources = [None] if any(shard is None for _, shard in layer._checkpoint) else list(layer.parts)
        for shard in sources:
            whole = self.scheme.unpack({name: layer._checkpoint[name, shard] for name in self.scheme.tensors})
            expected = (layer.whole_rows(shard), layer.input_whole)
            if tuple(whole.codes.shape) != expected:
                raise ValueError(
                    f"checkpoint weights of shape {tuple(whole.codes.shape)}, the model expects {expected}"
                )
            fields, perm = to_fields(whole)
            perms.append(perm)
            for local, source, rows in layer.rows_of(shard):
                pieces.append((local, _rows(fields, source, rows)))
        if any((p is None) != (perms[0] is None) or p is not None and not torch.equal(p, perms[0]) for p in perms):
            raise ValueError("the shards of one fused layer order their input columns differently (GPTQ's g_idx)")
        fields = _cat([f for _, f in sorted(pieces, key=lambda piece: piece[0])])
        if layer.input_part is not None:
            if perms[0] is not None:
                raise ValueError("activation order (desc_act) with tensor parallelism splitting a layer's inputs")
            fields = _columns(fields, *layer.input_part)
        for name in self.scheme.tensors:
            delattr(layer, name)
        del layer._checkpoint
        layer._perm = perms[0]
        runs_as = fields.format.name
        self.install(layer, [(pack(fields), fields.format, layer.out_features)], (f"{self.scheme.label} as {runs_as}",))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return super().apply(layer, _permuted(layer, x))

    def apply_silu_and_mul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return super().apply_silu_and_mul(layer, _permuted(layer, x))

    def apply_product(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return super().apply_product(layer, _permuted(layer, x))

    def kernel_spec(self, layer: Linear) -> KernelSpec | None:
        return None if layer._perm is not None else super().kernel_spec(layer)

    def product_kernel_spec(self, layer: Linear) -> KernelSpec | None:
        return None if layer._perm is not None else super().product_kernel_spec(layer)


def _permuted(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    return x if layer._perm is None else x.index_select(-1, layer._perm)


def _keep(layer: Linear, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """A checkpoint tensor of one shard (or of the whole layer, shard None), kept until all are in."""
    layer._checkpoint[name, shard_id] = loaded


def _rows(fields: Fields, start: int, count: int) -> Fields:
    def part(values: np.ndarray | None) -> np.ndarray | None:
        return None if values is None else values[start : start + count]

    return Fields(fields.format, part(fields.codes), part(fields.scale), part(fields.minimum))


def _cat(parts: list[Fields]) -> Fields:
    def joined(values: list[np.ndarray | None]) -> np.ndarray | None:
        return None if values[0] is None else np.ascontiguousarray(np.concatenate(values))

    if len({p.format.name for p in parts}) > 1:
        raise ValueError(
            f"the shards of one fused layer run as {', '.join(p.format.name for p in parts)}: "
            "some symmetric, some with zero points"
        )
    return Fields(
        parts[0].format,
        joined([p.codes for p in parts]),
        joined([p.scale for p in parts]),
        joined([p.minimum for p in parts]),
    )


def _columns(fields: Fields, start: int, count: int) -> Fields:
    """A row-parallel rank's input columns, whole blocks of them."""
    if start % BLOCK or count % BLOCK:
        raise ValueError(
            f"this rank's input columns {start}..{start + count} are not whole blocks of {BLOCK} values: "
            "choose a --tensor-parallel-size whose shares are"
        )
    blocks = slice(start // BLOCK, (start + count) // BLOCK)

    def part(values: np.ndarray | None) -> np.ndarray | None:
        return None if values is None else np.ascontiguousarray(values[:, blocks])

    codes = np.ascontiguousarray(fields.codes[:, start : start + count])
    return Fields(fields.format, codes, part(fields.scale), part(fields.minimum))
