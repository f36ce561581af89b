"""GGUF files: metadata to a Hugging Face config, tensors dequantized and renamed to HF names."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures of experts: the router, a shared expert and its gate (Qwen2-MoE)...
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# ... and the routed experts, stacked in one [experts, rows, columns] tensor a projection: each
# expert's rows become its own tensor, "mlp.experts.E.<projection>".
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Matrices that load unquantized whatever their type in the file: routers (llama.cpp keeps them F32).
_ALWAYS_DEQUANTIZED = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GGUFFormat:
    """How a family's GGUF files differ from the shared layout; each family's class declares its own
    (`gguf`), and models/registry.py names the file architecture (general.architecture) it reads."""

    # Tensor names (after "blk.N.") the family's files use otherwise, over the shared _LAYER_NAMES.
    layer_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # llama.cpp's converter interleaves the Q/K rows for its rotary layout (Llama, Mistral).
    permuted_qk: bool = False
    # ... stores the norm weights plus 1 (Gemma's RMSNorm multiplies by the weight as it is).
    norm_plus_one: bool = False
    # The name transformers' GGUF mappings key the architecture by, where it is not the file's.
    transformers_key: str | None = None
    # Tensors that are config, not weights (file name -> config field), read by `config`.
    config_tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # The family's transformers config from the file (its reader and the mapped values); None:
    # the shared GGUF config (models/gguf_config.py).
    config: Callable[[Any, dict], Any] | None = None

    def names(self) -> dict[str, str]:
        return {**_LAYER_NAMES, **self.layer_names}


SHARED = GGUFFormat()
# Config fields every family needs, and the metadata key (after "<arch>.") each comes from.
_REQUIRED_KEYS = {
    "hidden_size": "embedding_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "intermediate_size": "feed_forward_length",
}

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _reader(path: str):
    """Parsed once per file, for the config, the tokenizer and the weights alike: a parse takes seconds."""
    try:
        return _mapped_reader_class()(path)
    except Exception as exc:  # the reader raises many types on a damaged file
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


@functools.cache
def _mapped_reader_class() -> type:
    """gguf's reader over a plain ndarray view of its memory map: the same mapped pages, but each of
    the parse's ~10^6 slices skips np.memmap's Python-level __getitem__/__array_finalize__ (2-3x faster)."""
    import gguf

    class MappedReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._mapped

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._mapped = value.view(np.ndarray)  # its base keeps the np.memmap, so the mapping, alive

    return MappedReader


def gguf_architecture(path: str) -> str:
    reader = _reader(path)
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")
    return field.contents()


def load_gguf_config(path: str):
    """A transformers config from our one parse of the metadata, keyed as transformers' GGUF loader keys it
    (models/gguf_config.py says why not its per-model classes).

    AutoConfig.from_pretrained(gguf_file=...) would parse the whole file again (seconds for a large
    vocabulary), so its renames and defaults are applied here to the fields we already read.
    """
    arch = gguf_architecture(path)
    fmt = file_format(path)  # (raises for an architecture no family reads)
    from pagedllm.models.gguf_config import gguf_config

    reader = _reader(path)
    values = _config_values(reader, arch, fmt)
    missing = [f"{arch}.{key}" for name, key in _REQUIRED_KEYS.items() if name not in values]
    if missing:
        raise ValueError(f"{path}: the GGUF metadata lacks {', '.join(missing)}, which a {arch} model needs")
    # Keys transformers' GGUF mapping leaves out but the model depends on.
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim:
        values["head_dim"] = int(head_dim)
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window:
        values["sliding_window"] = int(window)
    values.update(_moe_values(reader, arch, values))
    config = fmt.config(reader, values) if fmt.config is not None else gguf_config(values)
    config.name_or_path = _folder(path)
    return config


def file_format(path: str) -> GGUFFormat:
    """The GGUF format of the family that reads this file's architecture (ValueError if none does)."""
    from pagedllm.models.registry import gguf_family

    arch = gguf_architecture(path)
    family = gguf_family(arch)
    if family is None:
        from pagedllm.models.registry import gguf_architectures

        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {sorted(gguf_architectures())})"
        )
    return family.gguf or SHARED


def _moe_values(reader, arch: str, values: dict) -> dict:
    """A mixture of experts' fields: the expert size, a shared expert's, and for a Llama file with
    experts (llama.cpp writes Mixtral so), Mixtral's model type and names."""
    count = _field(reader, f"{arch}.expert_count")
    if not count:
        return {}
    extra = {
        "moe_intermediate_size": _field(reader, f"{arch}.expert_feed_forward_length"),
        "shared_expert_intermediate_size": _field(reader, f"{arch}.expert_shared_feed_forward_length"),
    }
    extra = {key: int(value) for key, value in extra.items() if value is not None}
    if arch == "llama":
        extra.update(
            model_type="mixtral",
            num_local_experts=int(count),
            num_experts_per_tok=int(_field(reader, "llama.expert_used_count")),
        )
    return extra


def _config_values(reader, arch: str, fmt: GGUFFormat) -> dict:
    """The config dict transformers' load_gguf_checkpoint builds, for the architectures we support."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    # transformers takes a llama file whose name is exactly "mistral" for a Mistral model.
    model_type = "mistral" if arch == "llama" and _field(reader, "general.name") == "mistral" else arch
    model_type = fmt.transformers_key or model_type
    # llama.cpp writes the output projection only when it is not the embedding matrix.
    values: dict = {"tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors)}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {}).items():
        values.setdefault(key, value)
    for key, field in reader.fields.items():
        prefix, _, rest = key.replace(arch, model_type).partition(".")
        name = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if name is None or name == -1:
            continue  # a key the config does not take; parsing only mapped keys skips the vocabulary
        value = field.contents()
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        values[name] = value.replace(arch, model_type) if isinstance(value, str) else value
    if "vocab_size" not in values and "tokenizer.ggml.tokens" in reader.fields:
        values["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return values


def family_config(config_class: str, architecture: str, values: dict, rope: dict | None = None, **fields):
    """A family's transformers config (transformers' `config_class`) from the shared GGUF values
    (read under its transformers_key's names), its rope parameters over the default, and its own
    `fields`."""
    import transformers

    values = {k: v for k, v in values.items() if k != "model_type"}
    rope = {"rope_type": "default", "rope_theta": float(values.pop("rope_theta", 10000.0)), **(rope or {})}
    return getattr(transformers, config_class)(**values, **fields, rope_parameters=rope, architectures=[architecture])


def field_value(reader, key: str):
    """A metadata field's value (None where the file has none)."""
    return _field(reader, key)


def _field(reader, key: str):
    field = reader.fields.get(key)
    return field.contents() if field is not None else None


# Tokenizer init arguments naming a special token, and the GGUF key of its id.
_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def load_gguf_tokenizer(path: str, config: object | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer transformers would build from this file, built from our one parse of it."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except (ImportError, AttributeError):  # transformers before 5 builds it from a whole-checkpoint dict
        import transformers

        logger.info(
            "transformers %s has no GGUF tokenizer converter taking metadata: reading %s again",
            transformers.__version__,
            path,
        )
        return _tokenizer_from_file(path)
    reader = _reader(path)
    tokenizer_dict, init_kwargs = _tokenizer_values(reader, GGUF_TOKENIZER_MAPPING)
    backend, extra_kwargs = convert_gguf_tokenizer(gguf_architecture(path), tokenizer_dict)
    cls = _tokenizer_class(config if config is not None else load_gguf_config(path))
    return cls(tokenizer_object=backend, name_or_path=_folder(path), **init_kwargs, **extra_kwargs)


def _tokenizer_values(reader, mapping: dict) -> tuple[dict, dict]:
    """(tokenizer_dict, init kwargs) as transformers' get_gguf_tokenizer reads them from a file."""
    groups = {
        group: {
            name: _field(reader, f"tokenizer.{key}")
            for key, name in renames.items()
            if f"tokenizer.{key}" in reader.fields
        }
        for group, renames in mapping.items()
    }
    tokenizer_dict, init_kwargs = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # Older sentencepiece files carry no flag, and llama.cpp then adds BOS.
        init_kwargs.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = _field(reader, f"tokenizer.ggml.{key}")
        init_kwargs[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    return tokenizer_dict, init_kwargs


def _tokenizer_class(config: object) -> type:
    """The class AutoTokenizer picks for a GGUF file: its model type's registered class, else the generic one."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    name = TOKENIZER_MAPPING_NAMES.get(config.model_type)
    # Mistral's own backend needs its tekken files, which a GGUF does not carry.
    if name is None or name == "MistralCommonBackend":
        return TokenizersBackend
    return tokenizer_class_from_name(name) or TokenizersBackend


def _tokenizer_from_file(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_folder(path), gguf_file=os.path.basename(path))


def _folder(path: str) -> str:
    """The name transformers gives a GGUF model: the folder it was loaded from."""
    return os.path.dirname(path) or "."


def iter_gguf_weights(
    path: str, config, keep_quantized: bool = False, device: str = "cpu"
) -> Iterator[tuple[str, object]]:
    """(Hugging Face name, tensor) for every tensor of the file, Q/K rows un-permuted: float32 tensors
    (dequantized on `device`: a GPU's weights never pass through the host as floats), or with
    `keep_quantized`, the quantized ones as their raw blocks (a GGUFTensor)."""
    from pagedllm.layers.quantization.formats import FORMATS
    from pagedllm.layers.quantization.gguf import gguf_tensor

    reader = _reader(path)
    fmt = file_format(path)
    names = fmt.names()
    for tensor in reader.tensors:
        if tensor.name in fmt.config_tensors:
            continue  # in the config
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
        type_name = tensor.tensor_type.name
        expert_names = _expert_names(tensor.name, shape)
        if expert_names is not None:  # stacked experts: one tensor each (the same rows, raw or not)
            if keep_quantized and type_name in FORMATS:
                experts = [gguf_tensor(tensor.data[e], type_name, shape[2]) for e in range(shape[0])]
            else:
                experts = list(_dequantized(tensor, shape, device))
            yield from zip(expert_names, experts)
            continue
        name = hf_name(tensor.name, names)
        if keep_quantized and type_name in FORMATS and len(shape) == 2 and not name.endswith(_ALWAYS_DEQUANTIZED):
            weight = gguf_tensor(tensor.data, type_name, shape[1])
            if fmt.permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
                weight.raw = unpermute_qk(weight.raw, _heads(config, name))
            yield name, weight
            continue
        weight = _dequantized(tensor, shape, device)
        if fmt.permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = unpermute_qk(weight, _heads(config, name))
        if fmt.norm_plus_one and name.endswith("norm.weight"):
            weight = weight - 1
        if name.endswith("shared_expert_gate.weight"):
            weight = weight.reshape(1, -1)  # one output row, however the file shapes it
        yield name, weight


def _dequantized(tensor, shape: tuple[int, ...], device: str) -> torch.Tensor:
    """A file tensor as float32 of `shape` on `device`: our formats' decoding where it knows the
    type (bit for bit the gguf package's: tests/test_quant_kernels.py), else the gguf package's."""
    from pagedllm.layers.quantization.formats import FORMATS, decode, dequantize

    if tensor.tensor_type.name in FORMATS:
        raw = np.asarray(tensor.data)
        fields = decode(raw.reshape(-1, raw.shape[-1]), FORMATS[tensor.tensor_type.name])
        return dequantize(fields, device).reshape(shape)
    import gguf

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape).to(device)


def _expert_names(gguf_name: str, shape: tuple[int, ...]) -> list[str] | None:
    """The per-expert Hugging Face names of a stacked expert tensor (or of its biases, gpt-oss's);
    None for any other tensor."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not match or match.group(2) not in _EXPERT_NAMES:
        return None
    layer, projection, kind = match.group(1), _EXPERT_NAMES[match.group(2)], match.group(3)
    return [f"model.layers.{layer}.mlp.experts.{e}.{projection}.{kind}" for e in range(shape[0])]


def _heads(config, name: str) -> int:
    return config.num_attention_heads if "q_proj" in name else config.num_key_value_heads


def tensor_types(path: str) -> dict[str, str]:
    """Each tensor's GGUF type (F32, Q4_K, ...) by its Hugging Face name (each expert's, for stacked experts)."""
    fmt = file_format(path)
    layer_names = fmt.names()
    types = {}
    for t in _reader(path).tensors:
        if t.name in fmt.config_tensors:
            continue
        names = _expert_names(t.name, tuple(int(n) for n in reversed(t.shape))) or [hf_name(t.name, layer_names)]
        types.update((name, t.tensor_type.name) for name in names)
    return types


def release_readers() -> None:
    """Drop the parsed files and their memory maps (once the weights are loaded: the maps' pages
    would otherwise stay in the resident set beside the packed copy)."""
    _reader.cache_clear()


def num_tensors(path: str) -> int:
    return len(_reader(path).tensors)


def hf_name(gguf_name: str, names: Mapping[str, str] = _LAYER_NAMES) -> str:
    """A tensor's Hugging Face name, by the family's layer names (GGUFFormat.names)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not match or match.group(2) not in names:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row interleave: per head, rows (2, half) were stored as (half, 2)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
