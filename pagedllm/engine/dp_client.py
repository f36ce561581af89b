"""Data parallelism: several engine cores (replicas, each a process with its own copy of the
weights, KV cache and scheduler) behind one frontend, as `--data-parallel-size N`.

The client answers the frontend's calls as one engine core would (core_client.py's interface). It
sends each new request to one replica and remembers which, so that its aborts, and the samples or
beams forked from it (they share its KV blocks), go to the same one. The choice:
  - a request forked from a held one goes where that one is;
  - else to the replica that already computed the longest run of the prompt's leading blocks
    (prefix-cache affinity: each replica's blocks are its own, so a shared system prompt is
    computed once per replica that serves it), unless that replica has more than AFFINITY_SLACK
    requests beyond the least loaded one, where the prompt's recompute costs less than the queue;
  - else (and among replicas with equal prefixes) to the least loaded: fewest unfinished requests.
What a replica computed is known only from what it was sent: the client keeps, for each, the block
hashes of the prompts it routed there, as many as the replica has KV blocks, least recently used
dropped first.

A step returns the outputs of the replicas that have finished one since the last call (waiting
for at least one), so a fast replica never waits for a slow one. Each replica binds its own share
of the cores (executor/cpu_binding.py: its ranks' lists) and gets an equal share of the KV cache
budget. A replica that dies fails the engine as a lone engine core's death does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from multiprocessing.connection import wait

from pagedllm.config import EngineArgs, ModelConfig, available_memory, parse_memory
from pagedllm.core.kv_cache_manager import extend_block_hashes
from pagedllm.core.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from pagedllm.core.request import RequestStatus, cache_root
from pagedllm.core.snapshot import EngineSnapshot
from pagedllm.engine.core_client import EngineCoreClient, ProcClient
from pagedllm.executor.cpu_binding import BIND_ENV, parse_cpu_binding
from pagedllm.multimodal import MultiModalFeature

logger = logging.getLogger("pagedllm")
AFFINITY_SLACK = 4


class PrefixRouter:
    """Picks a replica for each new request (the rules in the module's docstring). Pure Python."""

    def __init__(self, num_replicas: int, block_size: int, capacity: list[int]) -> None:
        self.block_size, self.capacity = block_size, capacity
        # Each replica's routed prompt blocks (hash -> None), least recently routed first.
        self.prefixes: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def choose(
        self,
        prompt_token_ids: list[int],
        root: Hashable,
        loads: list[int],
        mm_features: Sequence[MultiModalFeature] = (),
    ) -> int:
        """The replica for a new prompt, given each replica's load; records the prompt's blocks there."""
        num_blocks = (len(prompt_token_ids) - 1) // self.block_size
        hashes = extend_block_hashes([], prompt_token_ids, self.block_size, root, num_blocks, mm_features)
        least = min(loads)
        eligible = [r for r, load in enumerate(loads) if load <= least + AFFINITY_SLACK]
        # The longest cached prefix first, then the lighter load, then the lower index.
        replica = max(eligible, key=lambda r: (self._matched(r, hashes), -loads[r], -r))
        self._record(replica, hashes)
        return replica

    def _matched(self, replica: int, hashes: list[int]) -> int:
        known = self.prefixes[replica]
        return next((i for i, h in enumerate(hashes) if h not in known), len(hashes))

    def _record(self, replica: int, hashes: list[int]) -> None:
        """The prompt's blocks, its first the most recent: a prefix is matched from its first
        block, so the deepest blocks go first when the replica's share is full."""
        known = self.prefixes[replica]
        for block_hash in reversed(hashes):
            known[block_hash] = None
            known.move_to_end(block_hash)
        while len(known) > self.capacity[replica]:
            known.popitem(last=False)


class DPClient(EngineCoreClient):
    """`args.data_parallel_size` engine cores, each in a process of its own (ProcClient)."""

    def __init__(self, args: EngineArgs, model_config: ModelConfig) -> None:
        size, tp = args.data_parallel_size, args.tensor_parallel_size
        binding = parse_cpu_binding(os.environ.get(BIND_ENV), size * tp, sorted(os.sched_getaffinity(0)))
        budget = parse_memory(args.kv_cache_memory, available_memory)
        replica_args = dataclasses.replace(
            args, data_parallel_size=1, engine_core_process=True, kv_cache_memory=budget // size
        )
        logger.info("data parallelism: %d engine replicas, %.2f GiB of KV cache each", size, budget / size / 2**30)
        self.replicas: list[ProcClient] = []
        try:  # all load at once, each on its own cores
            for r in range(size):
                cores = binding[r * tp : (r + 1) * tp] if binding is not None else None
                self.replicas.append(ProcClient(replica_args, model_config, cores, wait=False))
            for replica in self.replicas:
                replica.wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        # Without prefix caching nothing is shared: routing by load alone (no blocks remembered).
        capacity = [r.stats().kv_blocks_total if args.enable_prefix_caching else 0 for r in self.replicas]
        self.router = PrefixRouter(size, args.block_size, capacity)
        self.owner: dict[str, int] = {}  # request id -> its replica, until it ends
        self._held: set[str] = set()  # held requests: owned until released, though finished
        self._snapshots: list[EngineSnapshot | None] = [None] * size  # asked for, come so far

    def add_request(self, message: EngineCoreRequest) -> None:
        replica = self.owner.get(message.fork_of) if message.fork_of is not None else None
        if replica is None:  # (a fork whose parent has gone computes its prompt whole, anywhere)
            loads = [r.num_unfinished for r in self.replicas]
            root = cache_root(message.cache_salt, message.lora_request)
            replica = self.router.choose(message.prompt_token_ids, root, loads, message.mm_features)
        self.owner[message.request_id] = replica
        if message.hold:
            self._held.add(message.request_id)
        self.replicas[replica].add_request(message)

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            replica = self.owner.pop(request_id, None)
            self._held.discard(request_id)
            if replica is not None:  # (None: it had already ended)
                by_replica.setdefault(replica, []).append(request_id)
        for replica, ids in by_replica.items():
            self.replicas[replica].finish_requests(ids, status)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def step(self) -> list[EngineCoreOutput]:
        """The outputs of every step the replicas have sent since the last call (waiting for one
        where any has work)."""
        busy = [r.connection for r in self.replicas if r.has_unfinished_requests()]
        if busy:
            wait(busy)
        # Every step a replica has sent, an idle one's too (after requests it was told to end): its stats.
        outputs = self.poll()
        for output in outputs:
            if output.finish_reason is not None and output.request_id not in self._held:
                self.owner.pop(output.request_id, None)
        return outputs

    def poll(self) -> list[EngineCoreOutput]:
        """What every replica has sent, without waiting."""
        return [output for replica in self.replicas for output in replica.poll()]

    def refresh(self) -> None:
        self.poll()

    def request_snapshot(self) -> None:
        for replica in self.replicas:
            replica.request_snapshot()

    def take_snapshots(self) -> list[EngineSnapshot] | None:
        """Every replica's snapshot once all have come (else None, and those that came are kept)."""
        for r, replica in enumerate(self.replicas):
            self._snapshots[r] = self._snapshots[r] or replica.take_snapshot()
        snapshots = [s for s in self._snapshots if s is not None]
        if len(snapshots) < len(self.replicas):
            return None
        self._snapshots = [None] * len(self.replicas)
        return snapshots

    def replica_stats(self) -> list[SchedulerStats]:
        return [r.stats() for r in self.replicas]

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()
