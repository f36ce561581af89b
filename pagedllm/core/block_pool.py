"""BlockPool: the KV cache's physical blocks, their reference counts, the free queue, and the
prefix cache (hash of a full block -> the block holding it)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and computed (prefix caching)


# Free blocks right after a request's last one that other requests take last, so that the request
# can grow into them (`get_new_blocks(after=...)`): a sequence's K/V then lies in long runs, which
# the attention kernel reads faster than scattered 16-token blocks (benchmarks/kv_layout.py).
SET_ASIDE = 8


class BlockPool:
    """Hands out free blocks and takes them back when no holder is left.

    The free queue is ordered, least recently freed first. A freed block keeps its hash and stays
    findable in the prefix cache until the queue hands it out again (LRU eviction); a prefix hit
    takes it out of the middle of the queue in O(1). A request that grows takes the blocks right
    after its last one while they are free and hold no cached content; up to SET_ASIDE uncached
    free blocks after its new last one move to the back of the queue, so that others take them
    last. Cached blocks are never taken out of their eviction order.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def is_free(self, block: KVBlock) -> bool:
        return block.block_id in self._free

    def get_new_blocks(self, n: int, after: KVBlock | None = None) -> list[KVBlock]:
        """n blocks, each with one reference: the ones following `after` (the requester's last
        block) while they are free and uncached, then the front of the free queue."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        taken = self._free_run_after(after.block_id, n) if after is not None else []
        for block in taken:
            del self._free[block.block_id]
        taken += [self._free.popitem(last=False)[1] for _ in range(n - len(taken))]
        for block in taken:
            self._evict(block)
            block.ref_cnt = 1
        if taken:
            for block in self._free_run_after(taken[-1].block_id, SET_ASIDE):
                self._free.move_to_end(block.block_id)
        return taken

    def _free_run_after(self, block_id: int, limit: int) -> list[KVBlock]:
        """Up to `limit` free, uncached blocks right after block_id, in order."""
        run = []
        for block in self.blocks[block_id + 1 : block_id + 1 + limit]:
            if block.block_id not in self._free or block.block_hash is not None:
                break
            run.append(block)
        return run

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference to each block (a prefix hit or a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go back to the free queue."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        """Make a full, computed block findable; the first block with a given content wins."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)
