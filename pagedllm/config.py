"""Engine configuration: EngineArgs (what a user sets) resolved into the configs each part reads
(scheduling, pooling, speculative decoding). Plain data: any layer may import it."""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# --quantization: a GGUF file's own types (auto, gguf), dequantized (none), a Hugging Face
# checkpoint quantized as it loads (int8, int4, int4_g32), or one quantized already (awq, gptq,
# compressed-tensors: its config's quant_method) (models/loader.py's resolve_quantization)
QUANTIZATION_CHOICES = ("auto", "gguf", "none", "int8", "int4", "int4_g32", "awq", "gptq", "compressed-tensors")
# --kv-cache-dtype, as vLLM spells it: auto (the model's dtype), bfloat16 (an fp32 model's K/V in
# half the bytes), fp8 (= fp8_e4m3), fp8_e5m2; each choice's torch dtype by name (None: the model's)
KV_CACHE_DTYPES = {
    "auto": None,
    "bfloat16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
KV_CACHE_DTYPE_CHOICES = tuple(KV_CACHE_DTYPES)
# --runner, as vLLM spells it: auto, generate (completions and chat), pooling (embeddings)
RUNNER_CHOICES = ("auto", "generate", "pooling")
MAX_BODY_BYTES = 8 * 1024 * 1024  # the server's default request body limit


POOLING_TYPES = ("MEAN", "CLS", "LAST")


@dataclass(frozen=True)
class PoolerConfig:
    """The model's pooling: `pooling_type` one of POOLING_TYPES, `normalize` its default."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"unknown pooling_type {self.pooling_type!r}; choose from {', '.join(POOLING_TYPES)}")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (--enable-lora): `max_loras` distinct adapters in one step (the worker's
    slots in each layer), each of rank up to `max_lora_rank`; `max_cpu_loras` adapters kept
    loaded in memory, the least recently used dropped past that (None: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


# The dtypes a model computes in and its KV cache holds, by their torch attribute names (the
# config stays plain data: workers turn a name into the torch dtype, getattr(torch, name)).
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """A model as the engine serves it, resolved from EngineArgs and its files (models/loader.py)."""

    path: str
    hf_config: Any  # the model's transformers config (read from config.json or the GGUF header)
    dtype: str  # one of DTYPES
    max_model_len: int
    is_gguf: bool
    eos_token_ids: frozenset[int]
    generation_defaults: dict = field(default_factory=dict)
    # "gguf": a GGUF file's quantized tensors stay quantized; a checkpoint's quant_method (awq,
    # gptq, compressed-tensors) or an online scheme (int8, int4, int4_g32); None: weights in
    # `dtype` (GGUF dequantized at load), as the loader's resolve_quantization decides.
    quantization: str | None = None
    kv_cache_dtype: str | None = None  # a value of KV_CACHE_DTYPES; None: `dtype`
    # What requests the engine serves: "generate" (completions, chat) and/or "embed" (resolve_tasks).
    supported_tasks: tuple[str, ...] = ("generate",)
    pooler_config: PoolerConfig = field(default_factory=PoolerConfig)
    is_causal: bool = True  # False: an encoder (no KV cache, prompts computed whole)
    mmproj: str | None = None  # the vision projector file beside a GGUF text model (EngineArgs.mmproj)
    lora: LoRAConfig | None = None  # LoRA adapters, where enabled (EngineArgs.enable_lora)
    # The decode batch sizes whose forward passes are captured as CUDA graphs (vLLM's
    # cudagraph_capture_sizes); empty: every pass eager (the CPU, --enforce-eager).
    cuda_graph_sizes: tuple[int, ...] = ()

    @property
    def cache_dtype(self) -> str:
        """What the KV cache holds: the model's dtype, or another (--kv-cache-dtype: bfloat16, fp8)."""
        return self.kv_cache_dtype or self.dtype

    @property
    def vocab_size(self) -> int:
        return text_config(self.hf_config).vocab_size

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        """The embedding sizes the model was trained to be cut to (`dimensions`): a config's
        matryoshka_dimensions, or every size up to its hidden size where it says is_matryoshka;
        None where it may not be cut."""
        dims = getattr(self.hf_config, "matryoshka_dimensions", None)
        if dims:
            return sorted(int(d) for d in dims)
        if getattr(self.hf_config, "is_matryoshka", False):
            return list(range(1, self.hf_config.hidden_size + 1))
        return None


METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # one of METHODS
    num_speculative_tokens: int  # the most drafts a step verifies for a request
    prompt_lookup_min: int = 2  # ngram
    prompt_lookup_max: int = 4  # ngram
    model: str | None = None  # draft_model: a path pagedllm loads (Hugging Face folder or GGUF file)
    quantization: str | None = None  # draft_model: as --quantization, for the draft (None: auto)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def describe(self) -> str:
        """One start-up line's worth: the method, its draft and how many tokens a step may verify."""
        source = (
            f"n-gram lookup in the context ({self.prompt_lookup_min}-{self.prompt_lookup_max} tokens)"
            if self.method == "ngram"
            else f"draft model {self.model}"
        )
        return f"{self.method}, up to {self.num_speculative_tokens} draft tokens a step from {source}"


def parse_speculative_config(config: dict | None) -> SpeculativeConfig | None:
    """vLLM's speculative_config dict, checked (None: no speculation). Raises ValueError on one it
    cannot serve, so that a bad flag stops the start, never a step: an unknown method or key,
    num_speculative_tokens < 1, a draft path that does not exist (the draft's vocabulary is checked
    against the target's when the engine loads, still before serving)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config is a dict (JSON object), got {type(config).__name__}")
    config = dict(config)
    method = config.pop("method", "draft_model" if "model" in config else None)
    if method not in METHODS:
        raise ValueError(f"speculative_config: unknown method {method!r}; supported: {', '.join(METHODS)}")
    k = config.pop("num_speculative_tokens", None)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
    if method == "ngram":
        max_n = config.pop("prompt_lookup_max", 4)
        min_n = config.pop("prompt_lookup_min", min(2, max_n) if isinstance(max_n, int) else 2)
        _no_more(config)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (min_n, max_n)):
            raise ValueError("speculative_config: prompt_lookup_min and prompt_lookup_max are integers")
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({min_n}) must be >= 1 and <= prompt_lookup_max ({max_n})"
            )
        return SpeculativeConfig(method, k, min_n, max_n)
    model = config.pop("model", None)
    quantization = config.pop("quantization", None)
    _no_more(config)
    if not isinstance(model, str) or not model:
        raise ValueError("speculative_config: method 'draft_model' needs a 'model' (a path)")
    if not os.path.exists(os.path.expanduser(model)):
        raise ValueError(f"speculative_config: the draft model {model!r} does not exist")
    return SpeculativeConfig(method, k, model=os.path.expanduser(model), quantization=quantization)


def _no_more(config: dict) -> None:
    if config:
        raise ValueError(f"speculative_config: unknown keys {sorted(config)}")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # False for encoder-only models: a prompt attends to all of itself, so it is computed in one step.
    chunked_prefill: bool = True
    # Slots past a sampling request's tokens that its step also holds: a draft model writes its
    # proposals' K/V there (num_speculative_tokens with draft-model speculation, else 0).
    num_lookahead_tokens: int = 0
    # While other requests decode, a step's tokens of the long prompts that arrived while they were
    # generating cost at most this share of the decoding requests' own tokens and attention
    # (Scheduler._prefill_room), so that they keep their pace; 0: the token budget alone.
    long_prefill_token_threshold: float = 0.0
    # Keys of attention that cost what one token through the layers' weights costs
    # (attention_keys_per_token); 0: a prompt token's attention is not counted.
    attention_keys_per_token: float = 0.0
    # Images (core/encoder_cache_manager.py), in embedding rows: what the encoder cache holds, and
    # what a step may encode (at least the largest image); 0: the model takes no images.
    encoder_cache_size: int = 0
    encoder_budget: int = 0
    # An image's tokens attend to each other both ways (Gemma 3): a step never ends inside an
    # image, nor does a request's run of prefix hits.
    whole_images: bool = False
    # LoRA adapters: the most distinct ones a step runs (the worker's slots); 0: no limit.
    max_loras: int = 0
    policy: str = "fcfs"  # one of SCHEDULING_POLICIES

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass
class EngineArgs:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes, "4GiB", or a fraction of free memory ("0.3")
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # What a long prompt's tokens a step may cost while other requests decode (SchedulerConfig);
    # None: DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD; 0: no hold.
    long_prefill_token_threshold: float | None = None
    # Images: the most a prompt may hold ({"image": N}; None: no limit), and the encoder cache's
    # size in embedding rows (None: room for 8 of the model's largest images).
    limit_mm_per_prompt: dict[str, int] | None = None
    mm_encoder_cache_tokens: int | None = None
    allowed_local_media_path: str | None = None  # file: image URLs are read only under this folder
    # A vision projector GGUF file (llama.cpp's mmproj) that makes a GGUF text model take images.
    mmproj: str | None = None
    seed: int = 0
    device: str = "cpu"
    served_model_name: str | None = None
    enable_prefix_caching: bool = True
    compile: bool = False  # torch.compile the elementwise torch paths (layers/compile.py)
    engine_core_process: bool = False  # the engine core in a process of its own (engine/core_proc.py)
    quantization: str | None = None  # one of QUANTIZATION_CHOICES; None: auto
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPE_CHOICES
    runner: str = "auto"  # one of RUNNER_CHOICES: which requests the engine serves (models/loader.py)
    pooler_config: dict | None = None  # {"pooling_type": "MEAN"|"CLS"|"LAST", "normalize": bool}
    # vLLM's: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    speculative_config: dict | None = None
    tensor_parallel_size: int = 1  # ranks the model's layers split over (worker processes)
    distributed_executor_backend: str | None = None  # "mp" (default where tensor_parallel_size > 1), "ray", "uni"
    data_parallel_size: int = 1  # engine replicas, a process each (engine/dp_client.py)
    # LoRA adapters (vLLM's flags): requests may name an adapter; LoRAConfig's limits.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's: "fcfs" (arrival order) or "priority" (requests' `priority`, lower first, then arrival;
    # a waiting request preempts running ones of a strictly lower priority).
    scheduling_policy: str = "fcfs"
    # The KV cache's second tier (LMCache's and vLLM's offloading flags name it alike): full blocks
    # written to an LMDB store in this directory as they are computed, read back for prefix hits
    # the memory no longer holds, across restarts; at most kv_offload_size bytes ("64GiB").
    kv_offload_dir: str | None = None
    kv_offload_size: int | str = "64GiB"
    # vLLM's GPU flags: no CUDA graphs (every pass eager); the share of the GPU's memory the engine
    # may take, weights, activations and KV cache together (None: 0.9 on a GPU; refused on the CPU,
    # whose KV cache --kv-cache-memory sizes).
    enforce_eager: bool = False
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        if self.kv_offload_dir is not None:
            if not self.enable_prefix_caching:
                raise ValueError("kv_offload_dir keeps prefix-cache blocks: it needs prefix caching enabled")
            if parse_memory(self.kv_offload_size, 0) < 1 << 20:
                raise ValueError(f"kv_offload_size must be at least 1MiB, got {self.kv_offload_size!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy {self.scheduling_policy!r}: expected one of {', '.join(SCHEDULING_POLICIES)}"
            )
        parse_speculative_config(self.speculative_config)  # a bad config stops the start before anything loads
        self.lora_config()  # (checks the LoRA limits)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size > 1 and not self.device.startswith("cpu"):
            raise ValueError(f"data parallelism runs its replicas on the CPU for now, not {self.device!r}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        utilization = self.gpu_memory_utilization
        if utilization is not None:
            if not self.device.startswith("cuda"):
                raise ValueError(
                    f"gpu_memory_utilization sizes the KV cache on a GPU; the device is {self.device!r} "
                    "(--kv-cache-memory sizes it there)"
                )
            if not (isinstance(utilization, (int, float)) and 0 < utilization <= 1):
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
            if self.kv_cache_memory is not None:
                raise ValueError("give gpu_memory_utilization or kv_cache_memory, not both")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and not (math.isfinite(threshold) and threshold >= 0):
            raise ValueError(f"long_prefill_token_threshold must be a finite number >= 0, got {threshold}")
        limits = self.limit_mm_per_prompt
        if limits is not None and (
            not isinstance(limits, dict)
            or set(limits) - {"image"}
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in limits.values())
        ):
            raise ValueError(f'limit_mm_per_prompt takes {{"image": N}} with N >= 0, got {limits!r}')
        if self.mm_encoder_cache_tokens is not None and self.mm_encoder_cache_tokens < 1:
            raise ValueError(f"mm_encoder_cache_tokens must be >= 1, got {self.mm_encoder_cache_tokens}")
        if self.distributed_executor_backend not in (None, "mp", "uni", "ray"):
            raise ValueError(
                f"distributed_executor_backend {self.distributed_executor_backend!r}: expected mp, ray or uni"
            )
        if self.distributed_executor_backend == "ray" and self.data_parallel_size > 1:
            raise ValueError(
                "data-parallel replicas run as local processes: the ray executor takes one replica "
                "(data_parallel_size 1) for now"
            )
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("the uni executor runs one rank: tensor_parallel_size > 1 needs mp or ray")

    def crosses_processes(self) -> bool:
        """Whether a request's parameters reach another process (pickled): the engine core's, a
        replica's, a tensor-parallel rank's."""
        backend = self.distributed_executor_backend or ("mp" if self.tensor_parallel_size > 1 else "uni")
        return self.engine_core_process or self.data_parallel_size > 1 or backend != "uni"

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def served_name(self) -> str:
        """The name clients ask for and metrics are labelled with: --served-model-name, else the model
        as given (the default model by its own name, not its file's path)."""
        return self.served_model_name or self.model or DEFAULT_MODEL_NAME

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def text_config(hf_config):
    """The language model's part of a config: a vision-language model's `text_config`, or the
    config itself (transformers' get_text_config). Every reading of the decoder's shape goes
    through it."""
    get = getattr(hf_config, "get_text_config", None)
    return get() if get is not None else hf_config


def head_dim(hf_config) -> int:
    """The attention head size of a Hugging Face config: its own `head_dim` where it sets one (Qwen3,
    Mistral), else hidden_size / heads. The one place this is worked out."""
    hf_config = text_config(hf_config)
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


@dataclass(frozen=True)
class KVCacheShape:
    """What a layer caches per token: `heads` (the whole model's; a rank holds its share) of
    `head_dim` each, as a K and a V tensor; or, `latent` (DeepSeek's multi-head latent attention),
    one tensor read as both: the compressed KV and the rotary key, one head shared by every query
    head, stored once."""

    heads: int
    head_dim: int
    latent: bool = False

    @property
    def tensors(self) -> int:
        return 1 if self.latent else 2


def kv_cache_shape(hf_config) -> KVCacheShape:
    hf_config = text_config(hf_config)
    if getattr(hf_config, "kv_lora_rank", None):
        return KVCacheShape(1, hf_config.kv_lora_rank + hf_config.qk_rope_head_dim, latent=True)
    return KVCacheShape(hf_config.num_key_value_heads, head_dim(hf_config))


def sliding_windows(hf_config) -> tuple[int | None, ...]:
    """Each layer's attention window (None: full attention), from a config's sliding_window and,
    where it has them, its layer_types."""
    hf_config = text_config(hf_config)
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (window,) * hf_config.num_hidden_layers


def attention_keys_per_token(hf_config) -> float:
    """How many keys of context a token attends to for the multiply-adds of one token through the
    layers' weights (q, k, v, o and a gated MLP, active experts only). Only full-attention layers
    count: a window's cost stops growing with the context. 0 where no layer attends to all of it."""
    hf_config = text_config(hf_config)
    d, heads = head_dim(hf_config), hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    hidden = hf_config.hidden_size
    ffn = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    ffn *= getattr(hf_config, "num_experts_per_tok", None) or 1
    weights = hidden * d * 2 * (heads + kv_heads) + 3 * hidden * ffn
    full_layers = sum(window is None for window in sliding_windows(hf_config))
    per_key = 2 * heads * d  # q.k and p.v, a multiply-add per dimension each
    return hf_config.num_hidden_layers * weights / (full_layers * per_key) if full_layers else 0.0


@dataclass(frozen=True)
class KVOffloadConfig:
    """What a worker's KV store is opened with: the directory, its budget in bytes, and the digest
    every key of this model starts with (engine/builder.py's `kv_model_digest`)."""

    path: str
    size_bytes: int
    model_digest: bytes  # 16 bytes


@dataclass(frozen=True)
class KVCacheGroups:
    """How a model's layers share KV blocks. Layers of one kind of attention (a window, or none) go
    in groups of equal size, each group with its own block tables, so that the blocks behind a
    window can be freed for the sliding layers while the full layers keep theirs (Gemma's mix):
    `windows[g]` is group g's window; layer l is in group `layer_group[l]` and keeps its K/V in cache
    tensor `layer_slot[l]`, which one layer of every group shares (a block id is a block of each of
    the `num_slots` tensors, owned by one group). Models whose layers are all alike: one group."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    @property
    def num_slots(self) -> int:
        return max(self.layer_slot) + 1


def kv_cache_groups(hf_config) -> KVCacheGroups:
    """Groups of gcd(layers of each kind) layers: Gemma 3 270M's 15 sliding and 3 full layers make
    five sliding groups and one full group of three."""
    windows = sliding_windows(hf_config)
    kinds = list(dict.fromkeys(windows))  # in order of first appearance
    size = math.gcd(*(windows.count(kind) for kind in kinds))
    group_windows: list[int | None] = []
    layer_group, layer_slot = [0] * len(windows), [0] * len(windows)
    for kind in kinds:
        layers = [i for i, window in enumerate(windows) if window == kind]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(kind)
    return KVCacheGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot))


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
}


def available_memory() -> int:
    """The machine's memory free for this process's use (psutil: imported here, as the GPU check's
    machine lacks it and needs it not)."""
    import psutil

    return psutil.virtual_memory().available


def parse_memory(value: int | float | str | None, available: int | Callable[[], int]) -> int:
    """Bytes from 123456, "4GiB", "512MB", or a fraction of `available` (bytes, or a function
    asked only where a fraction or the default needs it) such as 0.3."""
    if callable(available):  # (a size in bytes reads the same whatever is available)
        available = available() if value is None or parse_memory(value, 0) == 0 else 0
    if value is None:
        return min(DEFAULT_KV_CACHE_MEMORY, available // 4)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value * available) if 0 < value < 1 else int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a memory size from {value!r} (try 4GiB, 512MiB or 0.3)")
    number, unit = float(match.group(1)), match.group(2).lower()
    if not unit and 0 < number < 1:
        return int(number * available)
    return int(number * _UNITS[unit])


def positive(kind: type):
    """An argparse type: a number above 0 (the bench commands' too)."""

    def parse(value: str):
        number = kind(value)
        if not number > 0:
            raise argparse.ArgumentTypeError(f"{value} must be > 0")
        return number

    return parse
