"""EngineCoreClient: the one interface the frontend (LLMEngine) reaches the engine core through,
wherever the core runs. The builder (engine/builder.py) picks one:

  - InprocClient: the EngineCore in the frontend's own thread;
  - ProcClient: the core in a process of its own (engine/core_proc.py) behind a Unix socket of
    pickled messages; it steps on its own while it has work and sends each step's outputs back, so
    the frontend's detokenizing runs beside the next forward pass (`docs/ARCHITECTURE.md` says
    which the server uses and why);
  - DPClient (engine/dp_client.py): one ProcClient per data-parallel replica.

All take and give the core's plain messages (core/messages.py).
"""

from __future__ import annotations

import subprocess
from abc import ABC, abstractmethod
from multiprocessing.connection import Connection

from pagedllm.child_process import start_child
from pagedllm.config import EngineArgs, ModelConfig
from pagedllm.core.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from pagedllm.core.request import RequestStatus
from pagedllm.core.snapshot import EngineSnapshot
from pagedllm.engine.engine_core import EngineCore


class EngineCoreDeadError(RuntimeError):
    """The engine core's process failed or exited."""


class EngineCoreClient(ABC):
    """What the frontend asks of the engine core."""

    @abstractmethod
    def add_request(self, message: EngineCoreRequest) -> None: ...

    @abstractmethod
    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests (abort, a stop string the frontend found) or release held ones; unknown
        ids are ignored."""

    @abstractmethod
    def step(self) -> list[EngineCoreOutput]:
        """The outputs of the core's next step (or of every replica's steps since the last call)."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def replica_stats(self) -> list[SchedulerStats]:
        """Each engine replica's stats as of its last step (one replica without data parallelism)."""

    def stats(self) -> SchedulerStats:
        """The replicas' stats together."""
        return SchedulerStats.merge(self.replica_stats())

    def refresh(self) -> None:  # (a core in this thread has nothing to take)
        """While idle: take what a core elsewhere has sent since its last step (its stats after
        releases and aborts; outputs only of requests already ended, dropped)."""

    @abstractmethod
    def request_snapshot(self) -> None:
        """Ask each replica for its snapshot (the dashboard's): taken at once in this thread, else
        with the core's next step (an idle core answers within a refresh)."""

    @abstractmethod
    def take_snapshots(self) -> list[EngineSnapshot] | None:
        """Each replica's snapshot asked for, once all have come (else None)."""

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    def core(self) -> EngineCore:
        """The EngineCore itself where it runs in this thread (a test hook), else RuntimeError."""
        raise RuntimeError("the engine core runs in a process of its own (engine_core_process)")


class InprocClient(EngineCoreClient):
    """The engine core in the caller's thread: each call is the core's own."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._snapshot: EngineSnapshot | None = None

    @property
    def core(self) -> EngineCore:
        return self._core

    def add_request(self, message: EngineCoreRequest) -> None:
        self._core.add_request(message)

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self._core.finish_requests(request_ids, status)

    def step(self) -> list[EngineCoreOutput]:
        return self._core.step()

    def has_unfinished_requests(self) -> bool:
        return self._core.has_unfinished_requests()

    def replica_stats(self) -> list[SchedulerStats]:
        return [self._core.stats()]

    def request_snapshot(self) -> None:
        self._snapshot = self._core.snapshot()

    def take_snapshots(self) -> list[EngineSnapshot] | None:
        snapshot, self._snapshot = self._snapshot, None
        return None if snapshot is None else [snapshot]

    def shutdown(self) -> None:
        self._core.shutdown()


class ProcClient(EngineCoreClient):
    """The engine core in a process of its own (`python -m pagedllm.engine.core_proc`, started as
    child_process.py starts children), reached through a Unix socket of pickled messages."""

    def __init__(
        self, args: EngineArgs, model_config: ModelConfig, cores: list[list[int]] | None = None, wait: bool = True
    ) -> None:
        """`cores`: each of its tensor-parallel ranks' cores (a data-parallel replica's share), else
        the core binds as one engine. `wait`: until the core has loaded (else wait_until_ready)."""
        self._process, self._conn = start_child("pagedllm.engine.core_proc")
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
    def pid(self) -> int:
        """The core process's id."""
        return self._process.pid

    @property
    def num_unfinished(self) -> int:
        return len(self._unfinished)

    def add_request(self, message: EngineCoreRequest) -> None:
        self._send(("add", message))
        self._unfinished.add(message.request_id)

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self._send(("finish", request_ids, status))
        self._unfinished.difference_update(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def request_snapshot(self) -> None:
        self._send(("snapshot",))

    def take_snapshot(self) -> EngineSnapshot | None:
        """The snapshot asked for, once a step has brought it (else None)."""
        snapshot, self._snapshot = self._snapshot, None
        return snapshot

    def take_snapshots(self) -> list[EngineSnapshot] | None:
        snapshot = self.take_snapshot()
        return None if snapshot is None else [snapshot]

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

    def refresh(self) -> None:
        self.poll()

    def replica_stats(self) -> list[SchedulerStats]:
        """As of the core's last step (or its start)."""
        return [self._stats]

    def shutdown(self) -> None:
        if self._process.poll() is None:
            try:
                self._conn.send(("shutdown",))
                self._process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
        self._conn.close()

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except OSError as exc:
            raise self._dead() from exc

    def _dead(self) -> EngineCoreDeadError:
        return EngineCoreDeadError(f"the engine core process exited (code {self._process.poll()})")

    def _receive(self):
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise self._dead() from exc
        if kind == "error":
            raise EngineCoreDeadError(f"the engine core failed: {payload}")
        return payload
