"""The multiprocess executor: one worker process per tensor-parallel rank, on this machine.

Each rank is a fresh interpreter (`python -m pagedllm.executor.multiproc`, started as
engine/child_process.py starts the engine core's process) on a Unix socket of its own. The engine
core (its process or the frontend's thread) sends every call to every rank (a step's
SchedulerOutput is a few KiB pickled) and takes rank 0's answer: the ranks sample the same tokens
from the same all-gathered logits, so each rank's model runner keeps the same state without being
told. Between them the ranks talk only through the collectives of distributed/parallel_state.py
(a shared-memory region on the CPU), inside the model's forward pass.

Each rank binds its own cores (PAGEDLLM_CPU_OMP_THREADS_BIND, executor/cpu_binding.py) and runs a
thread per physical core.

A rank that dies (killed, out of memory) is seen at once: its socket closes, and the executor,
which waits on every rank's socket together, raises ExecutorFailure, which the engine core takes
as fatal. A rank whose parent goes away reads the end of its socket and exits (on Linux the kernel
also kills it, should it be waiting in a collective); shutdown(), the executor's garbage collection
and the interpreter's exit end the others, so that no process is left behind.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import threading
import traceback
import weakref
from multiprocessing import shared_memory
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.core.step import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import SharedRegion
from pagedllm.engine.child_process import connect_to_parent, start_child
from pagedllm.executor.cpu_binding import BIND_ENV, parse_cpu_binding, physical_cores_of
from pagedllm.executor.abstract import Executor, ExecutorFailure
from pagedllm.models.loader import ModelConfig
from pagedllm.worker.model_runner import kv_cache_bytes_per_block

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 600.0  # a rank's load of a large model from a slow disk
ERROR_GRACE_S = 30.0  # after one rank's error, how long the others may take to report theirs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, model_config: ModelConfig, device: str, block_size: int, tensor_parallel_size: int,
                 seed: int | None = None) -> None:
        self.model_config, self.block_size, self.size = model_config, block_size, tensor_parallel_size
        binding = parse_cpu_binding(os.environ.get(BIND_ENV), tensor_parallel_size, sorted(os.sched_getaffinity(0)))
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        # The ranks' collectives on the CPU (parallel_state.SharedRegion); removed with the executor.
        self.region = SharedRegion.create(tensor_parallel_size)
        self.processes: list[subprocess.Popen] = []
        self.pipes: list[Connection] = []
        # Stops the ranks and removes the region: at shutdown, when the engine is dropped without
        # one (an LLM going out of scope), at exit, or when the start fails.
        self._stop = weakref.finalize(self, _stop_workers, self.processes, self.pipes, self.region)
        try:
            for rank in range(tensor_parallel_size):
                process, pipe = start_child("pagedllm.executor.multiproc")
                self.processes.append(process)
                self.pipes.append(pipe)
                pipe.send((rank, tensor_parallel_size, init_method, self.region.name, model_config, device,
                           block_size, binding[rank] if binding is not None else None, seed,
                           threading.current_thread() is threading.main_thread()))
            logger.info("tensor parallelism: %d worker processes (cores %s)", tensor_parallel_size,
                        "unbound" if binding is None else " | ".join(",".join(map(str, c)) for c in binding))
            self._collect(timeout=STARTUP_TIMEOUT_S)  # each rank's "ready"
        except BaseException:
            self._stop()
            raise

    def kv_cache_bytes_per_block(self) -> int:
        """A block on all ranks together (the widest rank's share, on each): the KV memory budget
        is the engine's, not each rank's."""
        return kv_cache_bytes_per_block(self.model_config, self.block_size, self.size) * self.size

    def load_model(self) -> None:
        self._call("load_model", timeout=STARTUP_TIMEOUT_S)

    def initialize_cache(self, num_blocks: int) -> None:
        self._call("initialize_cache", num_blocks, timeout=STARTUP_TIMEOUT_S)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", scheduler_output)

    def collective_time(self) -> tuple[float, int, int]:
        """Rank 0's seconds in collectives, their number and its bytes in them since the last call (benchmarks)."""
        return self._call("collective_time")

    def shutdown(self) -> None:
        self._stop()

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Every rank's `method(*args)`; rank 0's result."""
        for rank, pipe in enumerate(self.pipes):
            try:
                pipe.send((method, args))
            except OSError as exc:
                raise ExecutorFailure(f"tensor-parallel rank {rank} is gone ({self._exit(rank)})") from exc
        return self._collect(timeout)[0]

    def _collect(self, timeout: float | None) -> list[Any]:
        """Each rank's answer, in rank order. The executor waits on every rank's pipe at once, so that
        a rank's death (its end of the socket closing) raises as it happens. An error every rank raised (the same
        inputs fail alike: a request's bad rows) is the step's, raised as the uniprocess executor
        would; one that only some raised, or ranks that stop answering after it (left waiting in
        a collective), is the executor's failure."""
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = {pipe: rank for rank, pipe in enumerate(self.pipes)}
        while pending:
            wait_s = ERROR_GRACE_S if errors else timeout
            ready = wait(list(pending), wait_s)
            if not ready:
                late = sorted(pending.values())
                raise ExecutorFailure(f"tensor-parallel ranks {late} did not answer in {wait_s:.0f} s" +
                                      (f" after rank {min(errors)} failed: {errors[min(errors)]}" if errors else ""))
            for pipe in ready:
                rank = pending[pipe]
                try:
                    status, value = pipe.recv()
                except (EOFError, OSError) as exc:
                    raise ExecutorFailure(f"tensor-parallel rank {rank} died ({self._exit(rank)})") from exc
                del pending[pipe]
                (errors if status == "error" else results)[rank] = value
        if errors and len(errors) < self.size:
            raise ExecutorFailure(f"tensor-parallel rank {min(errors)} failed alone: {errors[min(errors)]}")
        if errors:
            raise RuntimeError(errors[0])
        return [results[rank] for rank in range(self.size)]

    def _exit(self, rank: int) -> str:
        try:
            code = self.processes[rank].wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        return "still running" if code is None else f"exit code {code}" if code >= 0 else f"signal {-code}"


def _stop_workers(processes: list[subprocess.Popen], pipes: list[Connection],
                  region: shared_memory.SharedMemory) -> None:
    for pipe in pipes:
        try:
            pipe.send(("shutdown", ()))
        except OSError:
            pass
    for process in processes:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    for pipe in pipes:
        pipe.close()
    region.close()
    region.unlink()


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the thread that started it ends (so only a main
    thread's ranks ask), whatever the rank is doing then: one waiting in a collective reads no pipe."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(rank: int, size: int, init_method: str, region: str, model_config: ModelConfig, device: str,
                 block_size: int,
                 cores: list[int] | None, seed: int | None, die_with_parent: bool, pipe: Connection) -> None:
    """A rank's process: join the group, then answer calls until shutdown or the pipe's end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle: it shuts the ranks down
    if die_with_parent:
        _die_with_parent()
    try:
        import torch

        from pagedllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
        from pagedllm.worker.worker import Worker

        if cores is not None:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(physical_cores_of(cores)))
        # The same seed on every rank: their samplers draw alike, so their runners keep one state.
        torch.manual_seed(seed if seed is not None else 0)
        init_tensor_parallel(rank, size, init_method, torch.device(device).type, shared_region=region)
        worker = Worker(model_config, device, block_size)
        pipe.send(("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the engine, which stops
        pipe.send(("error", traceback.format_exc(limit=8)))
        return
    try:
        while True:
            try:
                method, args = pipe.recv()
            except EOFError:  # the engine is gone
                break
            if method == "shutdown":
                break
            try:
                result = getattr(worker, method)(*args)
            except Exception as exc:  # noqa: BLE001 - the engine decides what it means
                pipe.send(("error", f"{type(exc).__name__}: {exc}"))
                continue
            pipe.send(("ok", result if rank == 0 else None))
    finally:
        destroy_tensor_parallel()


if __name__ == "__main__":
    with connect_to_parent() as connection:
        _worker_main(*connection.recv(), connection)
