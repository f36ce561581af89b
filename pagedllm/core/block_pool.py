"""BlockPool: the KV cache's physical blocks, their reference counts and the free queue."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """Hands out free blocks and takes them back when no holder is left.

    The free queue is ordered (least recently freed first) so that cached blocks can later be
    evicted LRU-first and taken out of the middle of the queue in O(1) on a prefix hit.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        taken = [self._free.popitem(last=False)[1] for _ in range(n)]
        for block in taken:
            block.ref_cnt = 1
        return taken

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go back to the free queue."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
