"""KVCacheManager: each request's block table, grown as its tokens arrive and freed when it ends."""
from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False if the pool is too small."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
        if needed > self.pool.num_free_blocks:
            return False
        if needed > 0:
            blocks.extend(self.pool.get_new_blocks(needed))
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        # Free the tail first so that, once prefix caching keeps freed blocks, the blocks a
        # later request is least likely to reuse are evicted first.
        blocks = self.req_blocks.pop(request.request_id, [])
        self.pool.free_blocks(list(reversed(blocks)))

    def num_allocated_slots(self) -> int:
        return sum(len(blocks) for blocks in self.req_blocks.values()) * self.block_size
