"""HybridKVCacheManager: a KV cache manager per group of layers (config.KVCacheGroups), all taking
blocks from one pool, behind the single manager's interface.

Gemma interleaves sliding-window layers with full ones. With one block table for all layers, a
long request would keep every block for the sliding layers too. Here each group of layers has its
own tables, so a sliding group frees the blocks behind its window (core/kv_cache_manager.py) while
the full group keeps its own; a block id is a block of each group's share of the cache tensors,
owned by one group at a time (vLLM V1's hybrid KV cache manager is built the same way).

Everything a request does, it does in every group at once: an allocation is planned in each and
taken only if the pool has room for all; a prefix hit is the run of blocks cached in every group;
forks, trims and frees go to each. The scheduler sees one manager: group 0's tables travel in a
step's usual fields, the others' beside them (ScheduledRequest.other_group_blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request


class Hits(list):
    """Prefix hits in every group: entry i is the tuple of each group's block for the i-th block."""


class HybridKVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        windows: tuple[int | None, ...],
        enable_prefix_caching: bool = True,
        debug: bool = False,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.groups = [
            KVCacheManager(num_blocks, block_size, enable_prefix_caching, debug, window, self.pool, g)
            for g, window in enumerate(windows)
        ]

    # -- what the scheduler reads ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def req_blocks(self) -> dict[str, list[KVBlock]]:
        """Group 0's tables (a request holds blocks in every group or in none)."""
        return self.groups[0].req_blocks

    @property
    def prefix_queries(self) -> int:
        return self.groups[0].prefix_queries

    @property
    def prefix_hits(self) -> int:
        return self.groups[0].prefix_hits

    def num_allocated_slots(self) -> int:
        return sum(group.num_allocated_slots() for group in self.groups)

    def num_stored_tokens(self, request: Request) -> int:
        return sum(group.num_stored_tokens(request) for group in self.groups)

    # -- prefix cache --------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> Hits:
        per_group = [group.get_computed_blocks(request) for group in self.groups]
        return Hits(zip(*per_group))  # as long as the shortest run

    def uncached_prompt_hashes(self, request: Request) -> list[int]:
        return self.groups[0].uncached_prompt_hashes(request)

    def step_block_hashes(self, request: Request, num_hits: int, num_new: int) -> list[int]:
        return self.groups[0].step_block_hashes(request, num_hits, num_new)

    def tier_candidates(self, request: Request, num_hits: int) -> list[tuple[int, ...]]:
        """Each block's key in every group (the second tier gives a block only where all groups have it)."""
        per_group = [group.tier_candidates(request, num_hits) for group in self.groups]
        return [tuple(key for (key,) in keys) for keys in zip(*per_group)]

    def blocks_to_save(self, request: Request, num_tokens: int) -> list[tuple[int, int]]:
        return [save for group in self.groups for save in group.blocks_to_save(request, num_tokens)]

    def cache_full_blocks(self, request: Request) -> None:
        for group in self.groups:
            group.cache_full_blocks(request)

    # -- allocation ----------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, computed: Sequence[Any] = ()) -> bool:
        """Room in every group, or (changing nothing but frees behind windows) False."""
        plans = [
            group.plan(request, num_new_tokens, [hit[g] for hit in computed]) for g, group in enumerate(self.groups)
        ]
        if sum(plan.num_blocks for plan in plans) > self.pool.num_free_blocks:
            return False
        for group, plan in zip(self.groups, plans):
            group.take_hits(request, plan)  # every group's hits out of the free queue first
        for group, plan in zip(self.groups, plans):
            group.take_new(request, num_new_tokens, plan)
        return True

    def trim(self, request: Request, lookahead: int = 0) -> None:
        for group in self.groups:
            group.trim(request, lookahead)

    def fork(self, parent: Request, child: Request) -> None:
        for group in self.groups:
            group.fork(parent, child)

    def free(self, request: Request) -> None:
        for group in self.groups:
            group.free(request)

    # -- what the worker is told ---------------------------------------------------------------------
    def take_new_block_ids(self, request_id: str, whole: bool = False) -> tuple[int, list[int]]:
        return self.groups[0].take_new_block_ids(request_id, whole)

    def take_other_group_block_ids(self, request_id: str, whole: bool = False) -> list[tuple[int, list[int]]]:
        return [group.take_new_block_ids(request_id, whole) for group in self.groups[1:]]

    def take_copies(self) -> list[tuple[int, int]]:
        return [copy for group in self.groups for copy in group.take_copies()]

    def block_ids(self, request_id: str) -> list[int]:
        return self.groups[0].block_ids(request_id)
