"""A LoRA adapter's files, read and checked without loading its weights: a PEFT folder's
`adapter_config.json` and its safetensors header (names, shapes), or llama.cpp's GGUF adapter
(`convert_lora_to_gguf.py`: general.type "adapter", adapter.lora.alpha, `<tensor>.lora_a` and
`.lora_b`). Plain data, no torch: the frontend checks an adapter against the model before any
request runs it; the worker loads the tensors the returned AdapterInfo names
(worker/lora_manager.py)."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass

from pagedllm.config import head_dim, text_config

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# The modules an adapter may target: attention's projections and a dense gated MLP's, by
# Hugging Face's names (Phi-3's fused qkv_proj and gate_up_proj too).
_TARGET = re.compile(
    r"model\.layers\.(\d+)\.(?:self_attn\.(q_proj|k_proj|v_proj|o_proj|qkv_proj)|mlp\.(gate_proj|up_proj|down_proj|gate_up_proj))"
)
_TENSOR = re.compile(r"(.+)\.lora_([AB])\.weight")
# adapter_config.json settings that change what the adapter computes and that we do not run, with
# the value that means "off".
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "lora_bias": False,
    "bias": "none",
    "modules_to_save": None,
    "layer_replication": None,
    "target_parameters": None,
}


# llama.cpp's names of the modules an adapter may target (after "blk.N."), as Hugging Face's.
_GGUF_MODULES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")


@dataclass(frozen=True)
class AdapterModule:
    """One module's low-rank update: W x + scaling * B (A x), A [rank, in], B [out, rank]."""

    name: str  # the model's module, e.g. "model.layers.0.self_attn.q_proj"
    rank: int
    scaling: float
    in_features: int
    out_features: int
    tensors: tuple[str, str] = ("", "")  # the file's names of its A and B


@dataclass(frozen=True)
class AdapterInfo:
    """A checked adapter: where its tensors are and what they update. `gguf_arch`: llama.cpp's
    architecture name of a GGUF adapter (None: a PEFT folder)."""

    path: str
    weights_file: str
    modules: tuple[AdapterModule, ...]
    gguf_arch: str | None = None

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)


def read_adapter(path: str) -> AdapterInfo:
    """A PEFT LoRA folder's (or llama.cpp's GGUF adapter's) modules, ranks and scalings (a
    ValueError naming the adapter says what is wrong with it)."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _read_gguf(path)
    if not os.path.isdir(path):
        raise ValueError(
            f"LoRA adapter {path!r} does not exist (a PEFT folder with {CONFIG_FILE}, or a GGUF adapter, expected)"
        )
    config_path = os.path.join(path, CONFIG_FILE)
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    if not os.path.isfile(weights):
        raise ValueError(
            f"LoRA adapter {path!r} has no {WEIGHTS_FILE} (.bin adapters are not read: save as safetensors)"
        )
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not readable JSON ({exc})") from None
    _check_config(path, config)
    shapes = _safetensors_shapes(weights)
    pairs: dict[str, dict[str, list[int]]] = {}
    for name, shape in shapes.items():
        match = _TENSOR.fullmatch(name.removeprefix(_PREFIX)) if name.startswith(_PREFIX) else None
        if match is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is not a LoRA A or B weight we apply")
        pairs.setdefault(match.group(1), {})[match.group(2)] = shape
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    modules = tuple(_module(path, name, pair, config) for name, pair in sorted(pairs.items()))
    return AdapterInfo(path, weights, modules)


def check_adapter(info: AdapterInfo, hf_config, max_lora_rank: int) -> None:
    """That the adapter fits the model: modules it has, of its shapes, ranks up to the maximum."""
    if info.max_rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {info.path!r} has rank {info.max_rank}, over --max-lora-rank {max_lora_rank}")
    expected = _module_shapes(text_config(hf_config))
    for module in info.modules:
        match = _TARGET.fullmatch(module.name)
        if match is None:
            raise ValueError(
                f"LoRA adapter {info.path!r} targets {module.name}: only attention's q/k/v/o and a dense MLP's "
                "gate/up/down projections take adapters"
            )
        layer, kind = int(match.group(1)), match.group(2) or match.group(3)
        num_layers = text_config(hf_config).num_hidden_layers
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {info.path!r} targets {module.name}; the model has {num_layers} layers")
        if kind not in expected:
            raise ValueError(
                f"LoRA adapter {info.path!r} targets {module.name}, which this model lacks (its MLPs are experts)"
            )
        want = expected[kind]
        if (module.out_features, module.in_features) != want:
            raise ValueError(
                f"LoRA adapter {info.path!r} does not fit this model: {module.name} is "
                f"[{module.out_features}, {module.in_features}] in the adapter, {list(want)} in the model"
            )


def _check_config(path: str, config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {config.get('peft_type')!r}, only LORA is served")
    for key, off in _UNSUPPORTED.items():
        value = config.get(key, off)
        if value != off and value not in (None, [], {}):
            raise ValueError(f"LoRA adapter {path!r}: {key}={value!r} is not supported")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"LoRA adapter {path!r}: lora_alpha {alpha!r} is not a number")


def _module(path: str, name: str, pair: dict[str, list[int]], config: dict) -> AdapterModule:
    a, b = pair.get("A"), pair.get("B")
    if a is None or b is None or len(a) != 2 or len(b) != 2 or a[0] != b[1] or a[0] < 1:
        raise ValueError(f"LoRA adapter {path!r}: {name} needs lora_A [r, in] and lora_B [out, r], got {a} and {b}")
    rank = a[0]
    alpha = _pattern_value(config.get("alpha_pattern") or {}, name, config.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = (f"{_PREFIX}{name}.lora_A.weight", f"{_PREFIX}{name}.lora_B.weight")
    return AdapterModule(name, rank, float(scaling), a[1], b[0], tensors)


def _read_gguf(path: str) -> AdapterInfo:
    """llama.cpp's LoRA adapter: its scaling alpha / rank as llama.cpp applies it (at scale 1)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {path!r} is not a readable GGUF file ({exc})") from None

    def field(key: str):
        entry = reader.fields.get(key)
        return entry.contents() if entry is not None else None

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise ValueError(f"{path!r} is a GGUF file but not a LoRA adapter (general.type {field('general.type')!r})")
    alpha = float(field("adapter.lora.alpha") or 0.0)
    pairs: dict[str, dict[str, tuple[str, list[int]]]] = {}
    for tensor in reader.tensors:
        match = _GGUF_TENSOR.fullmatch(tensor.name)
        if match is None or match.group(2) not in _GGUF_MODULES:
            raise ValueError(f"LoRA adapter {path!r}: tensor {tensor.name!r} is not a LoRA A or B weight we apply")
        name = f"model.layers.{match.group(1)}.{_GGUF_MODULES[match.group(2)]}"
        shape = [int(d) for d in reversed(tensor.shape)]  # ggml's order, innermost first
        pairs.setdefault(name, {})[match.group(3)] = (tensor.name, shape)
    modules = []
    for name, pair in sorted(pairs.items()):
        if set(pair) != {"a", "b"}:
            raise ValueError(f"LoRA adapter {path!r}: {name} needs both lora_a and lora_b")
        (a_name, a), (b_name, b) = pair["a"], pair["b"]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1] or a[0] < 1:
            raise ValueError(f"LoRA adapter {path!r}: {name} has lora_a {a} and lora_b {b}")
        modules.append(AdapterModule(name, a[0], alpha / a[0] if alpha else 1.0, a[1], b[0], (a_name, b_name)))
    if not modules:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    return AdapterInfo(path, path, tuple(modules), str(field("general.architecture")))


def _pattern_value(patterns: dict, name: str, default: float) -> float:
    """PEFT's per-module override: the first pattern that matches the end of the module's name."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?(?:{pattern})", name):
            return value
    return default


def _module_shapes(text) -> dict[str, tuple[int, int]]:
    """(out, in) of each module an adapter may target, from the model's config."""
    hidden, q = text.hidden_size, text.num_attention_heads * head_dim(text)
    kv = text.num_key_value_heads * head_dim(text)
    shapes = {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "qkv_proj": (q + 2 * kv, hidden),
        "o_proj": (hidden, q),
    }
    if getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None):
        return shapes
    inter = text.intermediate_size
    return shapes | {
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter),
    }


def _safetensors_shapes(path: str) -> dict[str, list[int]]:
    """Each tensor's shape from a safetensors file's header (8 bytes of length, then JSON)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 * 2**20:
                raise ValueError("header too large")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise ValueError(f"{path!r} is not a readable safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return {name: list(entry["shape"]) for name, entry in header.items()}
