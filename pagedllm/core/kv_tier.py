"""KVTier: the core's books of the KV cache's second tier (the workers' KV store on disk,
worker/kv_store.py): which block hashes it holds, the reads in flight, and how fast it reads.

Full blocks are written through: the step that completes a block asks its worker to store it
(`ScheduledRequest.kv_saves`), so that a block evicted from memory, a preempted request's blocks
and every block after a restart are found there. A waiting request whose prompt continues past its
memory hits with blocks the store holds first reads them (`SchedulerOutput.kv_loads`, into blocks
taken for the read alone), where reading is measured faster than computing them; the answer makes
them memory hits, cached as if computed, and the request is admitted at a later step as usual. A
block the store could not give whole is forgotten and computed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.core.step import KVStoreReport

# Until measured: what a read and a prompt token are taken to cost (a read of a block from the page
# cache is about a memory copy; a token of prefill on a CPU, a millisecond or more).
INITIAL_READ_BYTES_PER_S = 1e9
INITIAL_PREFILL_S_PER_TOKEN = 1e-3
SMOOTHING = 0.2  # weight of each new measurement in the running estimates


@dataclass
class KVTierStats:
    """Totals since the start, for /metrics and the dashboard."""

    hit_blocks: int = 0  # blocks read back instead of computed
    failed_blocks: int = 0  # reads the store could not give whole
    read_bytes: int = 0
    read_seconds: float = 0.0
    write_blocks: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0


@dataclass
class KVTier:
    stored: set[int]  # block hashes (every group's pool keys) the store holds, as far as the core knows
    block_bytes: int  # a block's bytes on all workers together
    block_size: int
    loading: dict[str, list[tuple[int, KVBlock]]] = field(default_factory=dict)  # request id -> its reads
    pinned: list[KVBlock] = field(default_factory=list)  # readers' memory hits, kept from eviction meanwhile
    _step_needs: int = 0  # blocks the requests reading this step will take once admitted
    tried: set[str] = field(default_factory=set)  # requests that read once since they last waited anew
    read_bytes_per_s: float = INITIAL_READ_BYTES_PER_S
    prefill_s_per_token: float = INITIAL_PREFILL_S_PER_TOKEN
    totals: KVTierStats = field(default_factory=KVTierStats)

    @classmethod
    def of(cls, stored: Iterable[int], block_bytes: int, block_size: int) -> KVTier:
        return cls(set(stored), block_bytes, block_size)

    # -- reads ---------------------------------------------------------------------------------------
    def start_load(
        self,
        request_id: str,
        candidates: Sequence[tuple[int, ...]],
        pool: BlockPool,
        hits: Sequence[KVBlock],
        positions_left: int,
        reserve: int,
    ) -> str:
        """Read the leading run of `candidates` (each position's key in every group) the store
        holds, where reading is the faster way: "started"; "wait" where the pool has no room for
        it this step; "no" where there is nothing worth reading (the request computes).

        The room counts what the reads take, the request's memory `hits` (held until the step
        ends, so that the reads do not evict them), the blocks it will take once admitted (of its
        `positions_left` past its hits, those past the run, in every group), those of the reads
        started before it this step, and `reserve` more (the running requests' growth). The
        blocks read wait in the free queue behind every other free block until their request is
        admitted at the next step, so that they are evicted only if all those go."""
        if request_id in self.tried or request_id in self.loading:
            return "no"
        run = 0
        while run < len(candidates) and all(h in self.stored for h in candidates[run]):
            run += 1
        keys = [h for position in candidates[:run] for h in position]
        if not keys or not self._worth_reading(run, len(keys)):
            return "no"
        revived = sum(1 for block in hits if pool.is_free(block))  # pinning takes them out of the free queue
        blocks_after = (positions_left - run) * len(candidates[0])
        if len(keys) + revived + blocks_after + self._step_needs + reserve > pool.num_free_blocks:
            return "wait"
        self.tried.add(request_id)
        pool.touch(list(hits))
        self.pinned += hits
        self.loading[request_id] = list(zip(keys, pool.get_new_blocks(len(keys))))
        self._step_needs += blocks_after
        return "started"

    def _worth_reading(self, positions: int, blocks: int) -> bool:
        read_s = blocks * self.block_bytes / max(self.read_bytes_per_s, 1.0)
        return read_s < positions * self.block_size * self.prefill_s_per_token

    def step_loads(self) -> list[tuple[int, int]]:
        """The reads this step's message carries: every started one (each is answered in the step)."""
        return [(h, block.block_id) for reads in self.loading.values() for h, block in reads]

    def finish_loads(self, report: KVStoreReport | None, pool: BlockPool) -> None:
        """After the step: blocks read whole become prefix-cache entries (the reading request finds
        them as memory hits); the others go back uncached. Either way the reads' hold ends."""
        loaded = set(report.loaded) if report is not None else set()
        failed = set(report.failed) if report is not None else set()
        for reads in self.loading.values():
            for block_hash, block in reads:
                if block_hash in loaded:
                    pool.cache_block(block, block_hash)
                elif block_hash in failed:
                    self.stored.discard(block_hash)
                pool.free_blocks([block])
        pool.free_blocks(self.pinned)
        self.totals.hit_blocks += len(loaded)
        self.totals.failed_blocks += len(failed)
        self.loading.clear()
        self.pinned = []
        self._step_needs = 0

    def forget(self, request_id: str) -> None:
        """A request that waits anew (preempted) may read again; one that ended is forgotten."""
        self.tried.discard(request_id)

    # -- writes and measurements ---------------------------------------------------------------------
    def note_saves(self, hashes: Iterable[int]) -> None:
        """Blocks a step asks the worker to store, counted as stored from now on (a write that
        fails comes back as dropped; a read that finds nothing is computed)."""
        self.stored.update(hashes)

    def take_report(self, report: KVStoreReport | None) -> None:
        if report is None:
            return
        self.stored.difference_update(report.dropped)
        t = self.totals
        t.read_bytes += report.read_bytes
        t.read_seconds += report.read_seconds
        t.write_blocks += report.write_blocks
        t.write_bytes += report.write_bytes
        t.write_seconds += report.write_seconds
        if report.read_bytes and report.read_seconds > 0:
            self.read_bytes_per_s += SMOOTHING * (report.read_bytes / report.read_seconds - self.read_bytes_per_s)

    def stats(self) -> dict[str, Any]:
        """SchedulerStats' kv_tier_* fields."""
        t = self.totals
        return {
            "kv_tier_blocks": len(self.stored),
            "kv_tier_bytes": len(self.stored) * self.block_bytes,
            "kv_tier_hits": t.hit_blocks,
            "kv_tier_failures": t.failed_blocks,
            "kv_tier_read_bytes": t.read_bytes,
            "kv_tier_read_seconds": t.read_seconds,
            "kv_tier_write_blocks": t.write_blocks,
            "kv_tier_write_bytes": t.write_bytes,
            "kv_tier_write_seconds": t.write_seconds,
        }

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step that computed `tokens` prompt tokens (and little else) in `seconds`."""
        if tokens >= self.block_size and seconds > 0:
            self.prefill_s_per_token += SMOOTHING * (seconds / tokens - self.prefill_s_per_token)
