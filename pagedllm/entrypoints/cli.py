"""The `pagedllm` command: `serve`, `run-batch -i IN -o OUT`, `generate`, `bench serve|throughput|latency`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from pagedllm.config import (
    KV_CACHE_DTYPE_CHOICES,
    MAX_BODY_BYTES,
    QUANTIZATION_CHOICES,
    RUNNER_CHOICES,
    SCHEDULING_POLICIES,
    EngineArgs,
    positive,
)
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.reasoning import REASONING_PARSERS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, spelled as vLLM spells them."""
    defaults = EngineArgs()
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="HF folder or .gguf file (default: SmolLM2-135M-Instruct); serve takes several (the first is the default)",
    )
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--dtype", default=defaults.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--kv-cache-memory", default=None, help="bytes, 4GiB, or a fraction of free memory")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=float,
        default=None,
        help="a long prompt (over 4%% of --max-model-len) that arrives while others generate is held, "
        "while they decode, to this share of what their own step costs (their tokens and their "
        "attention), each prompt token counted with its attention over the context before it, so "
        "that they keep their pace "
        "(default: 0.5; 0: only --max-num-batched-tokens)",
    )
    parser.add_argument(
        "--limit-mm-per-prompt",
        type=_json_object,
        default=None,
        help="the most images a prompt may hold, as JSON: '{\"image\": 2}' (default: no limit)",
    )
    parser.add_argument(
        "--mm-encoder-cache-tokens",
        type=int,
        default=None,
        help="the encoder cache's size in image embeddings (default: 8 of the model's largest images)",
    )
    parser.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="a folder whose images requests may name by file: URL (default: none may)",
    )
    parser.add_argument(
        "--mmproj",
        default=None,
        help="a vision projector GGUF file (llama.cpp's mmproj) for a GGUF model: images in (Gemma 3's)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--device", default=defaults.device, help="cpu (the default) or cuda")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on a GPU, run every forward pass eagerly (no CUDA graphs for decode steps); the CPU's always are",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="on a GPU, the share of its memory the engine takes: weights, a step's activations and "
        "the KV cache, which gets the rest (default 0.9; --kv-cache-memory sizes the cache instead)",
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=defaults.enable_prefix_caching,
        help="share KV blocks of common prompt prefixes",
    )
    parser.add_argument(
        "--kv-offload-dir",
        default=None,
        help="a directory for the KV cache's second tier: full blocks kept on disk (LMDB) as they are "
        "computed and read back for prefix hits memory no longer holds, after a restart too",
    )
    parser.add_argument(
        "--kv-offload-size",
        default=defaults.kv_offload_size,
        help="the most the --kv-offload-dir store holds (least recently used blocks go first); default 64GiB",
    )
    parser.add_argument(
        "--engine-core-process",
        action=argparse.BooleanOptionalAction,
        default=defaults.engine_core_process,
        help="run the scheduler and the model in a process of their own (default: a thread)",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=list(QUANTIZATION_CHOICES),
        help="weights' format: auto (a GGUF file's own quantized types, or a quantized checkpoint's "
        "own method, computed on as they are), gguf, awq, gptq, compressed-tensors (the same, asked "
        "for), none (dequantized at load to --dtype); for an unquantized Hugging Face checkpoint, "
        "int8 (per channel), int4 (groups of 128) or int4_g32 (groups of 32)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=defaults.kv_cache_dtype,
        choices=list(KV_CACHE_DTYPE_CHOICES),
        help="what the KV cache holds: auto (the model's dtype), fp8 or fp8_e4m3 (e4m3, scale 1), "
        "fp8_e5m2: one byte a value, twice the tokens in the same memory, half the bytes "
        "decode attention reads",
    )
    parser.add_argument(
        "--runner",
        default=defaults.runner,
        choices=list(RUNNER_CHOICES),
        help="which requests to serve: generate (completions, chat), pooling (embeddings), or auto "
        "(an encoder or a sentence-transformers folder: embeddings; other decoders: both)",
    )
    parser.add_argument(
        "--pooler-config",
        type=_json_object,
        default=None,
        help='how embeddings pool, as JSON: {"pooling_type": "MEAN"|"CLS"|"LAST", "normalize": '
        "true|false} (default: the model folder's sentence-transformers modules, else the family's)",
    )
    parser.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (drafts from the request\'s own tokens)',
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive(int),
        default=defaults.tensor_parallel_size,
        help="split the model's layers over this many worker processes (ranks), each on its own "
        "cores (PAGEDLLM_CPU_OMP_THREADS_BIND: auto, or core lists like 0-7|8-15)",
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=positive(int),
        default=defaults.data_parallel_size,
        help="serve with this many engine replicas (a process each, with its own copy of the "
        "weights, its share of the cores and of the KV cache budget); a request goes to the "
        "replica holding its prompt's prefix, else to the least loaded",
    )
    parser.add_argument(
        "--distributed-executor-backend",
        default=None,
        choices=["mp", "ray", "uni"],
        help="how the ranks run: mp (a process each on this machine, the default with -tp > 1), "
        "ray (a Ray actor each, on the Ray cluster this machine reaches, else a local Ray: "
        "pip install 'pagedllm[ray]') or uni (one, in the engine's process)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the elementwise work the C++ kernels do not take (other devices, dtypes)",
    )
    parser.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (requests name one as their model)"
    )
    parser.add_argument(
        "--max-loras", type=positive(int), default=defaults.max_loras, help="the most distinct adapters in one step"
    )
    parser.add_argument(
        "--max-lora-rank", type=positive(int), default=defaults.max_lora_rank, help="the largest adapter rank served"
    )
    parser.add_argument(
        "--max-cpu-loras",
        type=positive(int),
        default=None,
        help="adapters kept loaded in memory, the least recently used dropped past it (default: --max-loras)",
    )
    parser.add_argument(
        "--scheduling-policy",
        default=defaults.scheduling_policy,
        choices=list(SCHEDULING_POLICIES),
        help="fcfs: arrival order; priority: requests' `priority` field, lower first, then arrival "
        "(a waiting request preempts running ones of a lower priority)",
    )


def _lora_module(value: str):
    from pagedllm.entrypoints.openai.serving_models import LoRAModulePath

    try:
        return LoRAModulePath.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


def _origins(value: str) -> list[str]:
    """Comma-separated, or a JSON list as vLLM takes it."""
    if value.strip().startswith("["):
        return [str(origin) for origin in json.loads(value)]
    return [origin.strip() for origin in value.split(",") if origin.strip()]


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """How the chat endpoint renders and reads conversations, and the adapters served (serve, run-batch)."""
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"; needs --tool-call-parser)',
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the format the model writes tool calls in (hermes: Qwen2.5/Qwen3, Hermes; llama3_json: Llama 3.1/3.2)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split the model's thinking (<think>...</think>) into reasoning_content",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=[],
        help='LoRA adapters served under their names: name=path, or JSON {"name", "path", "base_model_name"}',
    )


def add_server_limits(parser: argparse.ArgumentParser) -> None:
    """What one client may ask of the server, and how it stops."""
    parser.add_argument(
        "--max-request-body-bytes",
        type=positive(int),
        default=MAX_BODY_BYTES,
        help="larger bodies get 413, counted as they arrive",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=positive(int),
        default=1024,
        help="past this many requests waiting to start, new ones get 503 with Retry-After",
    )
    parser.add_argument(
        "--request-timeout",
        type=positive(float),
        default=None,
        help="seconds a request may take from admission to its last token (default: no limit)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM, seconds in-flight requests get to finish before they are ended",
    )
    parser.add_argument(
        "--allowed-origins",
        type=_origins,
        default=[],
        help="CORS origins allowed (comma-separated or a JSON list); CORS is off without it",
    )


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def engine_args(ns: argparse.Namespace) -> dict:
    """The engine's arguments; `--model` is one model (serve alone takes several: _models)."""
    args = {name: getattr(ns, name) for name in EngineArgs.field_names() if hasattr(ns, name)}
    models = args.get("model") or [None]
    if len(models) > 1 and getattr(ns, "command", None) != "serve":
        raise ValueError(f"--model given {len(models)} times: only serve takes several models")
    args["model"] = models[0]
    return args


def _generate(ns: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.sampling_seed,
        stop=ns.stop or None,
        n=ns.n,
    )
    llm = LLM(**engine_args(ns))
    if ns.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(ns.prompts, params, use_tqdm=False)
    for output in outputs:
        for sample in output.outputs:
            print(sample.text if ns.chat else (output.prompt or "") + sample.text)
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import ServerLimits, run_server

    args = engine_args(ns)
    args["model"] = ns.model_path or args["model"]
    chat = _chat_options(ns)
    limits = ServerLimits(
        max_body_bytes=ns.max_request_body_bytes, request_timeout=ns.request_timeout, allowed_origins=ns.allowed_origins
    )
    return run_server(
        EngineArgs(**args),
        ns.host,
        ns.port,
        ns.api_key,
        chat,
        limits,
        ns.max_waiting_requests,
        ns.shutdown_timeout,
        ns.lora_modules,
        _models(ns),
    )


def _models(ns: argparse.Namespace):
    """Several models: the other --model entries (by their file or folder name) and --models-dir's."""
    from pagedllm.entrypoints.openai.api_server import ModelsOptions
    from pagedllm.entrypoints.openai.router import models_in

    given = ([ns.model_path] if ns.model_path else []) + (ns.model or [])
    others = {os.path.basename(os.path.normpath(p)).removesuffix(".gguf"): p for p in given[1:]}
    if len(others) < len(given) - 1:
        raise ValueError("--model entries must have different file or folder names (they are served by them)")
    if ns.models_dir is not None:
        others |= {name: path for name, path in models_in(ns.models_dir).items() if name not in others}
    if not others:
        return None
    return ModelsOptions(others, ns.max_loaded_models, ns.model_idle_ttl, ns.model_load_timeout)


def _chat_options(ns: argparse.Namespace):
    from pagedllm.entrypoints.openai.serving_chat import ChatOptions

    return ChatOptions(
        _read_template(ns.chat_template), ns.enable_auto_tool_choice, ns.tool_call_parser, ns.reasoning_parser
    )


def _run_batch(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.run_batch import run_batch

    args = engine_args(ns)
    args["model"] = ns.model_path or args["model"]
    return run_batch(
        EngineArgs(**args),
        ns.input_file,
        ns.output_file,
        _chat_options(ns),
        ns.lora_modules,
        ns.max_concurrency,
        not ns.disable_progress_bar,
    )


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read the chat template {path}: {exc.strerror}") from exc


def _add_bench(commands) -> None:
    from pagedllm.benchmarks import latency, serve, throughput

    bench = commands.add_parser("bench", help="benchmarks, with vLLM's `vllm bench` options")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve.add_cli_args(
        kinds.add_parser("serve", help="streaming requests against a running OpenAI-compatible server (any engine)")
    )
    for name, module, text in (
        ("throughput", throughput, "offline: every request at once, tokens a second"),
        ("latency", latency, "offline: seconds a batch takes, its percentiles"),
    ):
        sub = kinds.add_parser(name, help=text)
        add_engine_args(sub)
        module.add_cli_args(sub)


def _bench(ns: argparse.Namespace) -> int:
    from pagedllm.benchmarks import latency, serve, throughput

    if ns.bench_command == "serve":
        result = serve.main(ns)
        return 0 if result["requests"] else 1
    module = throughput if ns.bench_command == "throughput" else latency
    logger = logging.getLogger("pagedllm")
    level = logger.level
    logger.setLevel(logging.WARNING)  # the results, not the start-up's lines
    try:
        module.main(ns, engine_args(ns))
    finally:
        logger.setLevel(level)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: paged-KV LLM inference")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument(
        "model_path", nargs="?", default=None, help="HF folder or .gguf file (default model if left out)"
    )
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or PAGEDLLM_API_KEY)")
    add_chat_args(serve)
    add_server_limits(serve)
    serve.add_argument(
        "--models-dir",
        default=None,
        help="serve every model in this folder too (subfolders with a config.json, .gguf files), "
        "each by its name, loaded when a request names it",
    )
    serve.add_argument(
        "--max-loaded-models", type=positive(int), default=2, help="models loaded at once, the default among them"
    )
    serve.add_argument(
        "--model-idle-ttl",
        type=positive(float),
        default=None,
        help="seconds a model other than the default may sit idle before it is unloaded (default: only to make room)",
    )
    serve.add_argument(
        "--model-load-timeout",
        type=positive(float),
        default=120.0,
        help="seconds a request waits for its model to load before it gets 503",
    )
    batch = commands.add_parser(
        "run-batch", help="an OpenAI batch file (JSONL: completions, chat, embeddings) in, its answers out in order"
    )
    batch.add_argument(
        "model_path", nargs="?", default=None, help="HF folder or .gguf file (default model if left out)"
    )
    batch.add_argument("-i", "--input-file", required=True, help="the batch file: one request a line")
    batch.add_argument("-o", "--output-file", required=True, help="where the answers go, a line each, in input order")
    batch.add_argument(
        "--max-concurrency",
        type=positive(int),
        default=None,
        help="requests in flight at once (default: 2 x --max-num-seqs)",
    )
    batch.add_argument("--disable-progress-bar", action="store_true")
    add_engine_args(batch)
    add_chat_args(batch)
    gen = commands.add_parser("generate", help="complete prompts offline and print the text")
    gen.add_argument("prompts", nargs="+")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append")
    gen.add_argument("-n", type=int, default=1)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    _add_bench(commands)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"serve": _serve, "run-batch": _run_batch, "generate": _generate, "bench": _bench}[ns.command](ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
