"""The Ray executor (`--distributed-executor-backend ray`): a Ray actor per tensor-parallel rank,
placed by a placement group, on one machine or across a Ray cluster's machines.

The engine joins the Ray instance it finds (RAY_ADDRESS, or one `ray start` runs on this machine;
one the caller already started in this process), else starts a local one, which it stops with the
executor. One bundle a rank, each with an equal share of the cluster's CPUs, packed onto as few
machines as hold them. The ranks join one torch.distributed group (gloo, rendezvous at rank 0's
address); where they all run on the engine's machine their collectives go through a
shared-memory region as multiproc.py's do, created and removed by the executor.

A rank whose actor dies (killed, out of memory, its machine gone) makes its call's object ref fail
at once, which the executor raises as ExecutorFailure (ranks.py). Shutdown kills the actors and
removes the placement group, whatever state the ranks are in.
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import SharedRegion, destroy_tensor_parallel
from pagedllm.executor.abstract import ExecutorFailure
from pagedllm.executor.ranks import STARTUP_TIMEOUT_S, RanksExecutor, answer, free_port, start_failure, start_rank

logger = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_S = 60.0


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'pagedllm[ray]'") from None
    return ray


class RankActor:
    """One rank in a Ray actor (made remote by the executor, so that Ray is imported only there)."""

    def where(self) -> tuple[str, str, int, int]:
        """This actor's machine (node id), its address, a free port on it, and its process id."""
        import ray

        address = ray.util.get_node_ip_address()
        return ray.get_runtime_context().get_node_id(), address, free_port(address), os.getpid()

    def start(
        self,
        rank: int,
        size: int,
        init_method: str,
        region: str | None,
        model_config: ModelConfig,
        device: str,
        block_size: int,
        threads: int,
        seed: int | None,
    ) -> tuple[str, Any]:
        self.rank = rank
        try:
            self.worker = start_rank(
                rank, size, init_method, region, model_config, device, block_size, None, threads, seed
            )
        except BaseException:  # noqa: BLE001 - reported to the engine, which stops
            return start_failure()
        return "ok", None

    def call(self, method: str, *args: Any) -> tuple[str, Any]:
        return answer(self.worker, self.rank, method, args)

    def stop(self) -> None:
        destroy_tensor_parallel()


class RayExecutor(RanksExecutor):
    def __init__(
        self,
        model_config: ModelConfig,
        device: str,
        block_size: int,
        tensor_parallel_size: int,
        seed: int | None = None,
    ) -> None:
        self.ray = ray = import_ray()
        self.model_config, self.block_size, self.size = model_config, block_size, tensor_parallel_size
        # What the ranks hold, freed by the finalizer: at shutdown, when the engine is dropped
        # without one, at exit, or when the start fails.
        self.state = _Ranks()
        self._stop = weakref.finalize(self, _stop_ranks, ray, self.state, _connect(ray))
        try:
            self._start(model_config, device, block_size, tensor_parallel_size, seed)
        except BaseException:
            self._stop()
            raise

    def _start(self, model_config: ModelConfig, device: str, block_size: int, size: int, seed: int | None) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        node_cpus = [int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node.get("Alive")]
        per_rank = cpus_per_rank(node_cpus, size)
        if per_rank == 0:
            raise ValueError(f"the Ray cluster has {sum(node_cpus)} CPUs: {size} tensor-parallel ranks need one each")
        self.state.placement = placement_group([{"CPU": per_rank}] * size, strategy="PACK")
        ready, _ = ray.wait([self.state.placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ValueError(
                f"Ray could not place {size} ranks of {per_rank} CPUs each in "
                f"{PLACEMENT_TIMEOUT_S:.0f} s (cluster: {ray.cluster_resources()})"
            )
        actor_class = ray.remote(RankActor)
        for rank in range(size):
            strategy = PlacementGroupSchedulingStrategy(self.state.placement, placement_group_bundle_index=rank)
            self.state.actors.append(actor_class.options(num_cpus=per_rank, scheduling_strategy=strategy).remote())
        where = ray.get([actor.where.remote() for actor in self.state.actors], timeout=STARTUP_TIMEOUT_S)
        nodes = {node for node, _, _, _ in where}
        self.state.pids = [pid for _, _, _, pid in where]
        if same_machine(nodes, ray.get_runtime_context().get_node_id()) and not _client_mode(ray):
            self.state.region = SharedRegion.create(size)
        region = self.state.region.name if self.state.region is not None else None
        _, address, port, _ = where[0]
        logger.info(
            "tensor parallelism: %d Ray actors of %d CPUs on %d machine(s), collectives through %s",
            size,
            per_rank,
            len(nodes),
            "shared memory" if region else f"gloo at {address}:{port}",
        )
        refs = [
            actor.start.remote(
                rank, size, f"tcp://{address}:{port}", region, model_config, device, block_size, per_rank, seed
            )
            for rank, actor in enumerate(self.state.actors)
        ]
        self._collect({ref: rank for rank, ref in enumerate(refs)}, STARTUP_TIMEOUT_S)

    def shutdown(self) -> None:
        self._stop()

    def _send(self, method: str, args: tuple) -> dict[Hashable, int]:
        # A step's arguments are a few KiB: sent inline with each call (a ray.put of them first
        # costs a round trip to the object store a step).
        return {actor.call.remote(method, *args): rank for rank, actor in enumerate(self.state.actors)}

    def _wait(self, handles: list, timeout: float | None) -> list:
        ready, _ = self.ray.wait(handles, num_returns=1, timeout=timeout)
        return ready

    def _receive(self, handle: Hashable, rank: int) -> tuple[str, Any]:
        try:
            return self.ray.get(handle)
        except self.ray.exceptions.RayError as exc:
            raise ExecutorFailure(f"tensor-parallel rank {rank} died ({type(exc).__name__})") from exc


@dataclass
class _Ranks:
    actors: list = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # each rank's process, on its machine
    placement: Any = None
    region: shared_memory.SharedMemory | None = None


def cpus_per_rank(node_cpus: list[int], size: int) -> int:
    """The most CPUs a rank can have, every rank as many, each rank on one machine: the largest c
    with sum(cpus // c) >= size over the machines (0: fewer CPUs than ranks)."""
    return next((c for c in range(max(node_cpus, default=0), 0, -1) if sum(n // c for n in node_cpus) >= size), 0)


def _client_mode(ray) -> bool:
    """Connected through Ray Client (ray://): the node Ray reports is the head's, not this machine."""
    return ray.util.client.ray.is_connected()


def same_machine(nodes: set[str], engine_node: str) -> bool:
    """Whether every rank runs on the engine's machine, so that their collectives can go through
    shared memory the engine makes (where the ranks have the C++ kernels)."""
    return nodes == {engine_node}


def _connect(ray) -> bool:
    """Join the Ray instance there is, or start one; True where this call initialized Ray (started
    or joined it), so that the executor's shutdown leaves it (a second Ray executor in the same
    process would lose its ranks with the first's shutdown: one engine a process)."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address and address != "auto":
        _check_reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except ConnectionError as exc:
        raise ValueError(f"no Ray cluster is reachable at RAY_ADDRESS={address}: {exc}") from exc
    return True


def _check_reachable(address: str) -> None:
    """Ray waits minutes on an address nothing answers at: a plain connection, tried first, fails in seconds."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"no Ray cluster is reachable at RAY_ADDRESS={address} ({exc}): start one with "
            "`ray start --head` there, or unset RAY_ADDRESS to start a local one"
        ) from None


def _stop_ranks(ray, state: _Ranks, started: bool) -> None:
    """Kill every rank (one waiting in a collective answers no call), then free their placement,
    the shared region, and the Ray instance this executor initialized; each step whatever the
    others did (a cluster gone at exit, a failed start whose own error must not be hidden)."""
    steps = [lambda: (state.region.close(), state.region.unlink()) if state.region is not None else None]
    if ray.is_initialized():  # (at exit, Ray's own hook may have run first: the actors went with it)
        steps += [lambda actor=actor: ray.kill(actor) for actor in state.actors]
        steps += [lambda: ray.util.remove_placement_group(state.placement) if state.placement is not None else None]
        steps += [ray.shutdown] if started else []
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - stopping goes on
            logger.warning("stopping the Ray ranks: %s", exc)
