"""The composition root: the one place that builds what runs the model (executors, workers, models,
compile options) and sizes the KV cache, and that picks where the engine core runs.

    client = make_client(args, load_config(args))

gives the frontend an EngineCoreClient (engine/core_client.py): the core in the frontend's own
thread, in a process of its own (whose main loop, engine/core_proc.py, builds its core here too),
or one process per data-parallel replica. Nothing above the client imports an executor or a model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.config import (
    EngineArgs,
    KVOffloadConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    attention_keys_per_token,
    available_memory,
    kv_cache_groups,
    parse_memory,
    parse_speculative_config,
)
from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_tier import KVTier
from pagedllm.core.scheduler import Scheduler
from pagedllm.digest import file_digest, int_digest
from pagedllm.engine.core_client import EngineCoreClient, InprocClient, ProcClient
from pagedllm.engine.dp_client import DPClient
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.faults import FaultInjector
from pagedllm.executor.abstract import Executor
from pagedllm.executor.cpu_binding import usable_cores
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.ray_executor import RayExecutor
from pagedllm.executor.uniproc import UniprocExecutor
from pagedllm.layers.attention import check_attention_backend
from pagedllm.layers.compile import compile_torch_paths
from pagedllm.models.loader import check_tensor_parallel, load_model_config
from pagedllm.models.registry import model_class
from pagedllm.multimodal.processing import tokens_per_image
from pagedllm.spec_decode import speculative_proposer
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.structured_output.xgrammar_backend import XgrammarBackend
from pagedllm.tokenizer import load_tokenizer
from pagedllm.worker.cuda_graph import capture_sizes
from pagedllm.worker.draft_runner import check_draft

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("pagedllm")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# Chosen with benchmarks/long_prefill.py (BENCHMARKS.md): decodes' p99 time between tokens while a
# long prompt prefills beside them, against the prompt's time to first token.
DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD = 0.5
IMAGES_IN_ENCODER_CACHE = 8


def _long_prefill_token_threshold(args: EngineArgs) -> float:
    threshold = args.long_prefill_token_threshold
    return DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD if threshold is None else threshold


def _encoder_budgets(args: EngineArgs, model_config: ModelConfig, batched: int) -> dict[str, Any]:
    """The encoder cache's rows (--mm-encoder-cache-tokens, else 8 of the largest images) and a
    step's encoder rows (--max-num-batched-tokens), each at least one image, and whether a step must
    hold whole images; none for text models."""
    largest = tokens_per_image(model_config.hf_config, model_config.path, model_config.mmproj)
    if not largest:
        return {}
    cache = args.mm_encoder_cache_tokens or IMAGES_IN_ENCODER_CACHE * largest
    if cache < largest:
        raise ValueError(f"mm_encoder_cache_tokens ({cache}) must hold an image: {largest} embeddings")
    whole = getattr(model_class(model_config.hf_config), "bidirectional_images", False)
    if whole and batched < largest:
        raise ValueError(
            f"max_num_batched_tokens ({batched}) must hold an image's {largest} tokens: this model's image "
            "tokens attend to each other both ways, so a step never cuts through an image"
        )
    return {"encoder_cache_size": cache, "encoder_budget": max(batched, largest), "whole_images": whole}


def load_config(args: EngineArgs) -> ModelConfig:
    """The model the arguments name, read from its files and checked (a ValueError says why not)."""
    config = load_model_config(
        args.model,
        args.dtype,
        args.max_model_len,
        args.device,
        args.quantization,
        args.kv_cache_dtype,
        args.runner,
        args.pooler_config,
        args.mmproj,
    )
    config.lora = args.lora_config()
    if config.lora is not None:
        _check_lora_model(config)
    config.cuda_graph_sizes = cuda_graph_sizes(args)
    return config


def cuda_graph_sizes(args: EngineArgs) -> tuple[int, ...]:
    """The decode batch sizes captured as CUDA graphs: on a GPU, unless --enforce-eager."""
    if args.enforce_eager or not args.device.startswith("cuda"):
        return ()
    return capture_sizes(args.max_num_seqs)


def _check_lora_model(config: ModelConfig) -> None:
    """LoRA adapters go on a text decoder's linear layers (a ValueError at start-up otherwise)."""
    if not config.is_causal or "generate" not in config.supported_tasks:
        raise ValueError("--enable-lora: LoRA adapters are served on text generation models only")
    if tokens_per_image(config.hf_config, config.path, config.mmproj):
        raise ValueError("--enable-lora: LoRA adapters on a vision-language model are not supported yet")


def make_client(
    args: EngineArgs, model_config: ModelConfig, tokenizer: Callable[[], PreTrainedTokenizerBase] | None = None
) -> EngineCoreClient:
    """The engine core where the arguments put it: one process per replica (--data-parallel-size),
    a process of its own (engine_core_process), else in the caller's thread. `tokenizer`: the
    frontend's, which an in-thread core's grammars compile with."""
    if args.data_parallel_size > 1:
        return DPClient(args, model_config)
    if args.engine_core_process:
        return ProcClient(args, model_config)
    return InprocClient(make_engine_core(args, model_config, tokenizer))


def make_engine_core(
    args: EngineArgs, model_config: ModelConfig, tokenizer: Callable[[], PreTrainedTokenizerBase] | None = None
) -> EngineCore:
    """Size the KV cache from the memory left before the weights load (on a GPU: after, from what
    they and a step's activations leave), load the model, build the core.
    `tokenizer`: gives the frontend's (its calling thread's copy), for compiling grammars (else the
    tokenizer loads when the first one is asked for)."""
    if args.seed is not None:
        torch.manual_seed(args.seed)
    set_threads()
    spec = parse_speculative_config(args.speculative_config)
    if spec is not None:
        logger.info("Speculative decoding: %s", spec.describe())
    draft_config = draft_model_config(spec, args, model_config)
    batched = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.block_size)
    if not model_config.is_causal and batched < model_config.max_model_len:
        raise ValueError(
            f"an encoder computes each prompt in one step: max_num_batched_tokens ({batched}) "
            f"must be at least max_model_len ({model_config.max_model_len})"
        )
    encoder = _encoder_budgets(args, model_config, batched)
    logger.info("Attention: %s kernels", check_attention_backend(args.device))
    executor = make_executor(args, model_config, draft_config)
    try:
        if args.compile:
            compile_torch_paths()
        per_block = executor.kv_cache_bytes_per_block()
        if args.device.startswith("cuda") and args.kv_cache_memory is None and per_block > 0:
            # On a GPU the cache takes what the weights and a step's activations leave (an
            # encoder keeps none).
            executor.load_model()
            budget = executor.device_kv_budget(args.gpu_memory_utilization or 0.9, batched, args.max_num_seqs)
            num_blocks = _num_kv_blocks(args, model_config, per_block, budget)
        else:
            num_blocks = _num_kv_blocks(args, model_config, per_block)
            executor.load_model()
        executor.initialize_cache(num_blocks, kv_offload_config(args, model_config))
        tier = _kv_tier(args, executor)
    except BaseException:
        executor.shutdown()  # no worker process outlives a failed start
        raise
    kv = _kv_cache_manager(args, model_config, num_blocks)
    lookahead = spec.num_speculative_tokens if spec is not None and spec.uses_draft_model else 0
    scheduler = Scheduler(
        SchedulerConfig(
            args.max_num_seqs,
            batched,
            model_config.max_model_len,
            chunked_prefill=model_config.is_causal,
            num_lookahead_tokens=lookahead,
            long_prefill_token_threshold=_long_prefill_token_threshold(args),
            attention_keys_per_token=attention_keys_per_token(model_config.hf_config)
            if model_config.is_causal
            else 0.0,
            max_loras=model_config.lora.max_loras if model_config.lora is not None else 0,
            policy=args.scheduling_policy,
            **encoder,
        ),
        kv,
        tier,
    )
    backend = XgrammarBackend(
        tokenizer or (lambda: load_tokenizer(model_config, args.tokenizer)),
        model_config.vocab_size,
        sorted(model_config.eos_token_ids),
    )
    return EngineCore(
        scheduler,
        executor,
        FaultInjector.from_env(),
        StructuredOutputManager(backend),
        speculative_proposer(spec),
        draft_tokens=lookahead,
    )


def make_executor(args: EngineArgs, model_config: ModelConfig, draft_config: ModelConfig | None) -> Executor:
    """One worker in this process ("uni", the default for one rank), a worker process per rank
    ("mp", the default for several), or a Ray actor per rank ("ray")."""
    size = args.tensor_parallel_size
    check_tensor_parallel(model_config, size)
    backend = args.distributed_executor_backend or ("mp" if size > 1 else "uni")
    if backend == "uni":
        return UniprocExecutor(model_config, args.device, args.block_size, draft_config)
    if draft_config is not None:
        raise ValueError(
            "draft-model speculation runs only in the engine's process (--distributed-executor-backend "
            "uni, one rank) for now"
        )
    if args.device != "cpu":
        raise ValueError(f"worker processes run on the CPU for now, not {args.device!r}")
    if backend == "ray":
        return RayExecutor(model_config, args.device, args.block_size, size, args.seed)
    return MultiprocExecutor(model_config, args.device, args.block_size, size, args.seed)


def draft_model_config(spec: SpeculativeConfig | None, args: EngineArgs, target: ModelConfig) -> ModelConfig | None:
    """The draft model's config (draft-model speculation), checked against the target's: its
    vocabulary, context and layers (a ValueError at start-up, before any weight loads)."""
    if spec is None or not spec.uses_draft_model:
        return None
    if tokens_per_image(target.hf_config, target.path, target.mmproj):
        raise ValueError("draft-model speculation does not take a vision-language model yet (ngram does)")
    draft = load_model_config(spec.model, args.dtype, None, args.device, spec.quantization, args.kv_cache_dtype)
    check_draft(target, draft)
    return draft


# Bumped whenever what a stored block's bytes mean changes (the cache tensors' layout, the hash chain).
KV_STORE_LAYOUT = 1
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


def kv_offload_config(args: EngineArgs, model_config: ModelConfig) -> KVOffloadConfig | None:
    if args.kv_offload_dir is None:
        return None
    if not model_config.is_causal:
        raise ValueError("kv_offload_dir: an encoder keeps no KV cache to offload")
    size = parse_memory(args.kv_offload_size, 0)
    return KVOffloadConfig(os.path.abspath(args.kv_offload_dir), size, kv_model_digest(args, model_config))


def kv_model_digest(args: EngineArgs, model_config: ModelConfig) -> bytes:
    """What a stored block's K/V depend on besides its tokens (and its adapter, in the block hash):
    the weights' and config's content (each file's digest computed once, digest.file_digest), the
    dtypes, the quantization, the block size and the tensor-parallel split."""
    path = model_config.path
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(WEIGHT_SUFFIXES) or n == "config.json")
        files = [os.path.join(path, n) for n in names]
    else:
        files = [path]
    files += [model_config.mmproj] if model_config.mmproj else []
    described = [
        f"layout={KV_STORE_LAYOUT}",
        f"dtype={model_config.dtype}",
        f"cache_dtype={model_config.cache_dtype}",
        f"quantization={model_config.quantization}",
        f"block_size={args.block_size}",
        f"tensor_parallel_size={args.tensor_parallel_size}",
        *(f"{os.path.basename(f)}={file_digest(f)}" for f in files),
    ]
    return int_digest(*(d.encode() for d in described)).to_bytes(16, "little")


def _kv_tier(args: EngineArgs, executor: Executor) -> KVTier | None:
    if args.kv_offload_dir is None:
        return None
    stored = executor.stored_block_hashes()
    logger.info("KV offload: %s holds %d blocks of this model", args.kv_offload_dir, len(stored))
    return KVTier.of(stored, executor.kv_cache_bytes_per_block(), args.block_size)


def _kv_cache_manager(
    args: EngineArgs, model_config: ModelConfig, num_blocks: int
) -> KVCacheManager | HybridKVCacheManager:
    """One manager where the layers are alike (with their shared window, if any), a hybrid one over
    a manager per group of layers where sliding and full layers mix (Gemma)."""
    debug = os.environ.get("PAGEDLLM_DEBUG") == "1"
    windows = kv_cache_groups(model_config.hf_config).windows if model_config.is_causal else (None,)
    if len(windows) == 1:
        return KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching, debug, windows[0])
    logger.info(
        "KV cache: %d groups of layers with their own block tables (windows %s)",
        len(windows),
        ", ".join(str(w or "none") for w in windows),
    )
    return HybridKVCacheManager(num_blocks, args.block_size, windows, args.enable_prefix_caching, debug)


def _num_kv_blocks(args: EngineArgs, model_config: ModelConfig, per_block: int, budget: int | None = None) -> int:
    """Blocks of `budget` bytes (else --kv-cache-memory, or a share of the free memory)."""
    if per_block == 0:  # an encoder: blocks are only the scheduler's count of each request's tokens
        logger.info("KV cache: none (an encoder computes each prompt whole)")
        return args.max_num_seqs * -(-model_config.max_model_len // args.block_size)
    if budget is None:
        budget = parse_memory(args.kv_cache_memory, _free_memory(args.device))
    num_blocks = budget // per_block
    tokens = num_blocks * args.block_size
    if tokens < model_config.max_model_len:
        raise ValueError(
            f"the KV cache budget ({budget / 2**30:.3f} GiB) holds {tokens} tokens, fewer than "
            f"max_model_len={model_config.max_model_len}: raise kv_cache_memory (on a GPU, "
            "gpu_memory_utilization) or lower max_model_len"
        )
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB of %s",
        num_blocks,
        args.block_size,
        tokens,
        num_blocks * per_block / 2**30,
        model_config.cache_dtype,
    )
    return num_blocks


def _free_memory(device: str) -> Callable[[], int]:
    """What a fraction of --kv-cache-memory is of: the GPU's free memory on a GPU, else the machine's."""
    if device.startswith("cuda"):
        return lambda: torch.cuda.mem_get_info(torch.device(device))[0]
    return available_memory


def set_threads() -> None:
    """One thread per physical core this process may use (fewer under a cgroup quota): hyper-threads
    only contend for the same vector units. The executor's governor lowers it while the machine is
    busy (executor/thread_governor.py)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(usable_cores())
