"""Where the engine core runs: in the frontend's own thread (the EngineCore itself), or in a process
of its own behind a pipe (EngineCoreProcClient), chosen by `EngineArgs.engine_core_process`.

Both answer the frontend's few calls (add_request, finish_requests, step, has_unfinished_requests,
stats, shutdown) with the same plain messages (core/messages.py). In a process, the core steps on
its own while it has work and sends each step's outputs back, so the frontend's detokenizing runs
beside the next forward pass; `docs/ARCHITECTURE.md` says which the server uses and why.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import threading
from multiprocessing.connection import Connection

import psutil
import torch

from pagedllm.config import (
    EngineArgs,
    SchedulerConfig,
    SpeculativeConfig,
    kv_cache_groups,
    parse_memory,
    parse_speculative_config,
)
from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.snapshot import EngineSnapshot
from pagedllm.engine.child_process import connect_to_parent, start_child
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.faults import FaultInjector
from pagedllm.executor.abstract import Executor
from pagedllm.executor.cpu_binding import BIND_ENV, usable_cores
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.ray_executor import RayExecutor
from pagedllm.executor.uniproc import UniprocExecutor
from pagedllm.layers.compile import compile_torch_paths
from pagedllm.models.loader import ModelConfig, check_tensor_parallel, load_model_config, load_tokenizer
from pagedllm.spec_decode import speculative_proposer
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.structured_output.xgrammar_backend import XgrammarBackend
from pagedllm.worker.draft_runner import check_draft

logger = logging.getLogger("pagedllm")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def make_engine_core(args: EngineArgs, model_config: ModelConfig, tokenizer=None) -> EngineCore:
    """Size the KV cache from the memory left before the weights load, load the model, build the core.
    `tokenizer`: the frontend's, for compiling grammars (else loaded when the first one is asked for)."""
    if args.seed is not None:
        torch.manual_seed(args.seed)
    set_threads()
    spec = parse_speculative_config(args.speculative_config)
    if spec is not None:
        logger.info("Speculative decoding: %s", spec.describe())
    draft_config = draft_model_config(spec, args, model_config)
    executor = make_executor(args, model_config, draft_config)
    try:
        num_blocks = _num_kv_blocks(args, model_config, executor.kv_cache_bytes_per_block())
        if args.compile:
            compile_torch_paths()
        executor.load_model()
        executor.initialize_cache(num_blocks)
    except BaseException:
        executor.shutdown()  # no worker process outlives a failed start
        raise
    batched = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.block_size)
    if not model_config.is_causal and batched < model_config.max_model_len:
        raise ValueError(
            f"an encoder computes each prompt in one step: max_num_batched_tokens ({batched}) "
            f"must be at least max_model_len ({model_config.max_model_len})"
        )
    kv = _kv_cache_manager(args, model_config, num_blocks)
    lookahead = spec.num_speculative_tokens if spec is not None and spec.uses_draft_model else 0
    scheduler = Scheduler(
        SchedulerConfig(
            args.max_num_seqs,
            batched,
            model_config.max_model_len,
            chunked_prefill=model_config.is_causal,
            num_lookahead_tokens=lookahead,
        ),
        kv,
    )
    backend = XgrammarBackend(
        (lambda: tokenizer) if tokenizer is not None else (lambda: load_tokenizer(model_config, args.tokenizer)),
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
    draft = load_model_config(spec.model, args.dtype, None, args.device, spec.quantization, args.kv_cache_dtype)
    check_draft(target, draft)
    return draft


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


def _num_kv_blocks(args: EngineArgs, model_config: ModelConfig, per_block: int) -> int:
    if per_block == 0:  # an encoder: blocks are only the scheduler's count of each request's tokens
        logger.info("KV cache: none (an encoder computes each prompt whole)")
        return args.max_num_seqs * -(-model_config.max_model_len // args.block_size)
    budget = parse_memory(args.kv_cache_memory, psutil.virtual_memory().available)
    num_blocks = budget // per_block
    tokens = num_blocks * args.block_size
    if tokens < model_config.max_model_len:
        raise ValueError(
            f"the KV cache budget ({budget / 2**30:.3f} GiB) holds {tokens} tokens, fewer than "
            f"max_model_len={model_config.max_model_len}: raise kv_cache_memory or lower max_model_len"
        )
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB of %s",
        num_blocks,
        args.block_size,
        tokens,
        num_blocks * per_block / 2**30,
        str(model_config.cache_dtype).split(".")[-1],
    )
    return num_blocks


def set_threads() -> None:
    """One thread per physical core this process may use (fewer under a cgroup quota): hyper-threads
    only contend for the same vector units. The executor's governor lowers it while the machine is
    busy (executor/thread_governor.py)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(usable_cores())


class EngineCoreDeadError(RuntimeError):
    """The engine core's process failed or exited."""


class EngineCoreProcClient:
    """The engine core in a process of its own (`python -m pagedllm.engine.core_client`, through
    child_process.py), reached through a Unix socket of pickled messages."""

    def __init__(
        self, args: EngineArgs, model_config: ModelConfig, cores: list[list[int]] | None = None, wait: bool = True
    ) -> None:
        """`cores`: each of its tensor-parallel ranks' cores (a data-parallel replica's share), else
        the core binds as one engine. `wait`: until the core has loaded (else wait_until_ready)."""
        self._process, self._conn = start_child("pagedllm.engine.core_client")
        self._conn.send((args, model_config, cores))
        # Requests the core may still send outputs for; the core's own view can run a message
        # behind, which only means a step's output for a request the frontend has ended (ignored).
        self._unfinished: set[str] = set()
        self._snapshot: EngineSnapshot | None = None
        if wait:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        self._stats: SchedulerStats = self._receive()

    @property
    def connection(self) -> Connection:
        """Readable when the core has sent a step's outputs."""
        return self._conn

    @property
    def num_unfinished(self) -> int:
        return len(self._unfinished)

    def add_request(self, message: EngineCoreRequest) -> None:
        self._conn.send(("add", message))
        self._unfinished.add(message.request_id)

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self._conn.send(("finish", request_ids, status))
        self._unfinished.difference_update(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def request_snapshot(self) -> None:
        """Ask for the core's snapshot (the dashboard's); it comes with a step (take_snapshot)."""
        self._conn.send(("snapshot",))

    def take_snapshot(self) -> EngineSnapshot | None:
        """The snapshot asked for, once a step has brought it (else None)."""
        snapshot, self._snapshot = self._snapshot, None
        return snapshot

    def step(self) -> list[EngineCoreOutput]:
        """The outputs of the core's next step (it may already have run)."""
        outputs, self._stats, snapshot = self._receive()
        self._snapshot = snapshot or self._snapshot
        for output in outputs:
            if output.finish_reason is not None:
                self._unfinished.discard(output.request_id)
        return outputs

    def poll(self) -> list[EngineCoreOutput]:
        """The outputs of every step the core has sent, without waiting (its stats taken too)."""
        outputs: list[EngineCoreOutput] = []
        while self._conn.poll():
            outputs += self.step()
        return outputs

    def stats(self) -> SchedulerStats:
        """As of the core's last step (or its start)."""
        return self._stats

    def shutdown(self) -> None:
        if self._process.poll() is None:
            try:
                self._conn.send(("shutdown",))
                self._process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
        self._conn.close()

    def _receive(self):
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise EngineCoreDeadError(f"the engine core process exited (code {self._process.poll()})") from exc
        if kind == "error":
            raise EngineCoreDeadError(f"the engine core failed: {payload}")
        return payload


def run_engine_core(conn: Connection) -> None:
    """The engine core process: build the core, then step while there is work, taking messages
    between steps (waiting for them when idle), and send each step's outputs and stats."""
    try:
        args, model_config, cores = conn.recv()
        if cores is not None:
            bind_replica(cores)
        core = make_engine_core(args, model_config)
    except BaseException as exc:  # noqa: BLE001 - the frontend raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    # Outputs leave through a thread of their own: were the loop to block on a full pipe while the
    # frontend blocks sending it a long prompt, neither would move.
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    sender = threading.Thread(target=_send_all, args=(conn, outbox), name="pagedllm-core-sender", daemon=True)
    sender.start()
    outbox.put(("ready", core.stats()))
    try:
        while True:
            rejected: list[EngineCoreOutput] = []
            snapshot = None
            # Idle: wait for messages, then take those there are; every batch is answered with a
            # step (empty where idle still), so that the frontend's stats follow an idle core's
            # releases and aborts.
            wait = None if not core.has_unfinished_requests() else 0
            while conn.poll(wait):
                message = conn.recv()
                if message[0] == "shutdown":
                    return
                if message[0] == "snapshot":
                    snapshot = core.snapshot()
                else:
                    rejected += _apply(core, message)
                wait = 0
            outputs = core.step() if core.has_unfinished_requests() else []
            outbox.put(("step", (rejected + outputs, core.stats(), snapshot)))
    except (EOFError, OSError):  # the frontend has gone (it exited without shutting the core down)
        return
    except BaseException as exc:  # noqa: BLE001 - the core's state is in doubt: the frontend stops
        logger.exception("engine core failed")
        outbox.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        outbox.put(None)
        sender.join()


def bind_replica(cores: list[list[int]]) -> None:
    """This engine core's process runs on its ranks' cores, and its executor binds each rank to its own."""
    os.sched_setaffinity(0, sorted({cpu for rank in cores for cpu in rank}))
    os.environ[BIND_ENV] = "|".join(",".join(map(str, rank)) for rank in cores)


def _send_all(conn: Connection, outbox: queue.SimpleQueue) -> None:
    while (item := outbox.get()) is not None:
        try:
            conn.send(item)
        except OSError:  # the frontend has gone
            return


def _apply(core: EngineCore, message: tuple) -> list[EngineCoreOutput]:
    """One message from the frontend; a request the core refuses ends with an error output."""
    if message[0] == "finish":
        core.finish_requests(message[1], message[2])
        return []
    try:
        core.add_request(message[1])
    except ValueError as exc:
        return [EngineCoreOutput(message[1].request_id, finish_reason="error", error=str(exc))]
    return []


if __name__ == "__main__":
    with connect_to_parent() as connection:
        run_engine_core(connection)
