"""The multiprocess executor: one worker process per tensor-parallel rank, on this machine.

Each rank is a fresh interpreter (`python -m pagedllm.executor.multiproc`, started as
engine/child_process.py starts the engine core's process) on a Unix socket of its own, bound to
its cores (PAGEDLLM_CPU_OMP_THREADS_BIND, executor/cpu_binding.py). The engine core (its process
or the frontend's thread) sends every call to every rank (a step's SchedulerOutput is a few KiB
pickled); what the ranks answer and how the answers are judged: ranks.py. Between them the ranks
talk only through the collectives of distributed/parallel_state.py (a shared-memory region on
the CPU), inside the model's forward pass.

A rank that dies (killed, out of memory) is seen at once: its socket closes, and the executor,
which waits on every rank's socket together, raises ExecutorFailure. A rank whose parent goes
away reads the end of its socket and exits (on Linux the kernel also kills it, should it be
waiting in a collective); shutdown(), the executor's garbage collection and the interpreter's
exit end the others, so that no process is left behind.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import weakref
from multiprocessing import shared_memory
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.child_process import connect_to_parent, start_child
from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import SharedRegion, destroy_tensor_parallel
from pagedllm.executor.abstract import ExecutorFailure
from pagedllm.executor.cpu_binding import BIND_ENV, parse_cpu_binding
from pagedllm.executor.ranks import STARTUP_TIMEOUT_S, RanksExecutor, answer, free_port, start_failure, start_rank

logger = logging.getLogger(__name__)


class MultiprocExecutor(RanksExecutor):
    def __init__(
        self,
        model_config: ModelConfig,
        device: str,
        block_size: int,
        tensor_parallel_size: int,
        seed: int | None = None,
    ) -> None:
        self.model_config, self.block_size, self.size = model_config, block_size, tensor_parallel_size
        binding = parse_cpu_binding(os.environ.get(BIND_ENV), tensor_parallel_size, sorted(os.sched_getaffinity(0)))
        init_method = f"tcp://127.0.0.1:{free_port()}"
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
                pipe.send(
                    (
                        rank,
                        tensor_parallel_size,
                        init_method,
                        self.region.name,
                        model_config,
                        device,
                        block_size,
                        binding[rank] if binding is not None else None,
                        seed,
                        threading.current_thread() is threading.main_thread(),
                    )
                )
            logger.info(
                "tensor parallelism: %d worker processes (cores %s)",
                tensor_parallel_size,
                "unbound" if binding is None else " | ".join(",".join(map(str, c)) for c in binding),
            )
            self._collect({pipe: rank for rank, pipe in enumerate(self.pipes)}, STARTUP_TIMEOUT_S)  # each "ready"
        except BaseException:
            self._stop()
            raise

    def shutdown(self) -> None:
        self._stop()

    def _send(self, method: str, args: tuple) -> dict[Connection, int]:
        for rank, pipe in enumerate(self.pipes):
            try:
                pipe.send((method, args))
            except OSError as exc:
                raise ExecutorFailure(f"tensor-parallel rank {rank} is gone ({self._exit(rank)})") from exc
        return {pipe: rank for rank, pipe in enumerate(self.pipes)}

    def _wait(self, handles: list, timeout: float | None) -> list:
        return wait(handles, timeout)

    def _receive(self, handle: Connection, rank: int) -> tuple[str, Any]:
        try:
            return handle.recv()
        except (EOFError, OSError) as exc:
            raise ExecutorFailure(f"tensor-parallel rank {rank} died ({self._exit(rank)})") from exc

    def _exit(self, rank: int) -> str:
        try:
            code = self.processes[rank].wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        return "still running" if code is None else f"exit code {code}" if code >= 0 else f"signal {-code}"


def _stop_workers(
    processes: list[subprocess.Popen], pipes: list[Connection], region: shared_memory.SharedMemory
) -> None:
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


def _worker_main(
    rank: int,
    size: int,
    init_method: str,
    region: str,
    model_config: ModelConfig,
    device: str,
    block_size: int,
    cores: list[int] | None,
    seed: int | None,
    die_with_parent: bool,
    pipe: Connection,
) -> None:
    """A rank's process: join the group, then answer calls until shutdown or the pipe's end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle: it shuts the ranks down
    if die_with_parent:
        _die_with_parent()
    try:
        worker = start_rank(rank, size, init_method, region, model_config, device, block_size, cores, None, seed)
        pipe.send(("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the engine, which stops
        pipe.send(start_failure())
        return
    try:
        while True:
            try:
                method, args = pipe.recv()
            except EOFError:  # the engine is gone
                break
            if method == "shutdown":
                break
            pipe.send(answer(worker, rank, method, args))
    finally:
        worker.shutdown()  # its KV store's queued writes
        destroy_tensor_parallel()


if __name__ == "__main__":
    with connect_to_parent() as connection:
        _worker_main(*connection.recv(), connection)
