"""KVCacheManager: each request's block table; prefix-cache hits, forks and copy-on-write.

A request's table grows as its tokens arrive and is freed when it ends. With prefix caching,
each full block is known by a hash chained over its parent's hash and its tokens (and the
request's cache salt), so a new request starts from the longest run of blocks already holding
its prefix. Forked requests (parallel samples, beams) share blocks by reference count; the first
write into a shared block copies it.

Where every layer attends through the same sliding window (Mistral's), the blocks a request's
queries can no longer see (wholly before its next query's window) are freed as it grows, so a long
request holds about a window's worth of blocks. Their entries stay in its table as FREED, so that
positions keep their indices; the worker keeps the ids it had there (or reads block 0 for them)
and never attends to them.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.core.request import Request
from pagedllm.digest import int_digest
from pagedllm.multimodal import MultiModalFeature


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# A table entry whose block was freed because it left the sliding window (sent as block id 0).
FREED = KVBlock(0)


@dataclass
class Allocation:
    """What allocate_slots would take for a request: planned, then committed if the pool has room."""

    start: int  # the first position written
    computed: list[KVBlock]  # prefix hits (FREED where behind the window)
    taken: list[KVBlock]  # the hits that are blocks
    needed: int  # new blocks
    copy: bool  # a shared block at `start` to copy on write
    revived: int  # hits that leave the free queue

    @property
    def num_blocks(self) -> int:
        """Free blocks it takes."""
        return max(self.needed, 0) + self.copy + self.revived


class KVCacheManager:
    """`pool` and `group`: a manager of one group of layers whose blocks come from a pool it shares
    with the other groups' managers (core/hybrid_kv_cache_manager.py); its prefix-cache entries
    are told apart from theirs by the group's number."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        debug: bool = False,
        sliding_window: int | None = None,
        pool: BlockPool | None = None,
        group: int = 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = pool if pool is not None else BlockPool(num_blocks)
        self.group = group
        self.enable_prefix_caching = enable_prefix_caching
        self.debug = debug  # assert that no shared or cached block is ever written
        self.sliding_window = sliding_window  # every layer's window: blocks behind it are freed
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_freed: dict[str, int] = {}  # leading entries of a request's table that are FREED
        self._num_cached: dict[str, int] = {}  # blocks of a request already in the prefix cache
        # Leading entries of a request's table the worker holds unchanged, where blocks were appended
        # or copied on write since it last heard (else all of them: a table cut back is told by its
        # length), so that each step sends it only the rest.
        self._num_unchanged: dict[str, int] = {}
        self.copies: list[tuple[int, int]] = []  # (src, dst) block copies the runner owes
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    # -- prefix cache ---------------------------------------------------------------------------
    def _caches(self, request: Request) -> bool:
        """Whether a request takes part in prefix caching. Embedding requests do not: pooling reads
        every prompt position's hidden state, which cached blocks do not hold, and an encoder's
        K/V depend on the tokens after them."""
        return self.enable_prefix_caching and request.pooling_params is None

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of cached blocks holding the start of a request that has none yet.

        The last token is always left to compute, so that the first sampled token has logits. A
        request that asks for prompt logprobs computes its whole prompt (as in vLLM): cached blocks
        hold K/V, not the logits of the positions they cover."""
        if (
            not self._caches(request)
            or request.num_computed_tokens
            or self.req_blocks.get(request.request_id)
            or request.sampling_params.prompt_logprobs is not None
        ):
            return []
        hashes = self._block_hashes(request, (request.num_tokens - 1) // self.block_size)
        hits = []
        for block_hash in hashes:
            block = self.pool.lookup(self._pool_hash(block_hash))
            if block is None:
                break
            hits.append(block)
        return hits

    def tier_candidates(self, request: Request, num_hits: int) -> list[tuple[int, ...]]:
        """The keys of the blocks after `num_hits` memory hits that a second tier could give (the
        same blocks get_computed_blocks would take), one 1-tuple a block (a group's key)."""
        if not self._caches(request) or request.num_computed_tokens:
            return []
        if request.sampling_params.prompt_logprobs is not None:
            return []
        hashes = self._block_hashes(request, (request.num_tokens - 1) // self.block_size)
        return [(self._pool_hash(h),) for h in hashes[num_hits:]]

    def blocks_to_save(self, request: Request, num_tokens: int) -> list[tuple[int, int]]:
        """(key, block id) of the request's blocks that are full once its first `num_tokens` tokens
        are computed and were not cached before: what a step computing up to there completes."""
        if not self._caches(request):
            return []
        blocks = self.req_blocks.get(request.request_id, [])
        start, end = self._num_cached.get(request.request_id, 0), min(num_tokens // self.block_size, len(blocks))
        if end <= start:
            return []
        hashes = self._block_hashes(request, end)
        return [(self._pool_hash(hashes[i]), blocks[i].block_id) for i in range(start, end) if blocks[i] is not FREED]

    def _pool_hash(self, block_hash: int) -> int:
        """A block's key in the pool's prefix cache: its hash, and for groups past the first, the
        group (the same tokens in another group's layers are another block)."""
        return block_hash if self.group == 0 else group_hash(self.group, block_hash)

    def _block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Hashes of the request's first `num_blocks` full blocks, extended on demand."""
        return extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            request.cache_root,
            num_blocks,
            request.mm_features,
        )

    def uncached_prompt_hashes(self, request: Request) -> list[int]:
        """Hashes of the request's full prompt blocks not in the prefix cache yet: the ones it
        computes in this step or a later one."""
        if not self._caches(request):
            return []
        num_full = request.num_prompt_tokens // self.block_size
        return self._block_hashes(request, num_full)[self._num_cached.get(request.request_id, 0) :]

    def step_block_hashes(self, request: Request, num_hits: int, num_new: int) -> list[int]:
        """The hashes of the full blocks that `num_new` tokens after `num_hits` cached blocks write into."""
        if not self._caches(request):
            return []
        hashes = self._block_hashes(request, (request.num_tokens - 1) // self.block_size)
        return hashes[num_hits : cdiv(num_hits * self.block_size + num_new, self.block_size)]

    def cache_full_blocks(self, request: Request) -> None:
        """After a step: make the request's newly full, computed blocks findable."""
        if not self._caches(request):
            return
        blocks = self.req_blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached.get(request.request_id, 0)
        if num_full <= start:
            return
        for block, block_hash in zip(blocks[start:num_full], self._block_hashes(request, num_full)[start:]):
            if block is not FREED:
                self.pool.cache_block(block, self._pool_hash(block_hash))
        self._num_cached[request.request_id] = num_full

    # -- allocation -----------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, computed: Sequence[KVBlock] = ()) -> bool:
        """Room for `num_new_tokens` more tokens after the computed ones (plus `computed` prefix
        hits for a request that has no blocks yet); False, changing nothing, if the pool is short
        (but for freeing its blocks behind the window, which it no longer needs in any case)."""
        plan = self.plan(request, num_new_tokens, computed)
        if plan.num_blocks > self.pool.num_free_blocks:
            return False
        self.commit(request, num_new_tokens, plan)
        return True

    def plan(self, request: Request, num_new_tokens: int, computed: Sequence[KVBlock] = ()) -> Allocation:
        """What allocating would take (after freeing the request's blocks behind the window)."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        start = request.num_computed_tokens + len(computed) * self.block_size
        hits = self._free_behind_window(request.request_id, blocks, computed, start)
        taken = [b for b in hits if b is not FREED]
        return Allocation(
            start,
            hits,
            taken,
            needed=cdiv(start + num_new_tokens, self.block_size) - len(blocks) - len(hits),
            copy=self._shared_block_at(blocks, start),
            revived=sum(1 for b in taken if self.pool.is_free(b)),
        )

    def commit(self, request: Request, num_new_tokens: int, plan: Allocation) -> None:
        """Take what `plan` planned; the pool must have room."""
        self.take_hits(request, plan)
        self.take_new(request, num_new_tokens, plan)

    def take_hits(self, request: Request, plan: Allocation) -> None:
        """commit's first half: the planned prefix hits, revived out of the free queue. Apart, so
        that managers sharing a pool (HybridKVCacheManager) take every group's hits before any
        takes new blocks, which could evict a hit another group planned on."""
        computed = plan.computed
        blocks = self.req_blocks[request.request_id]
        if self._caches(request) and not blocks:  # a first allocation: count the lookup
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(computed) * self.block_size
        if computed:
            self.pool.touch(plan.taken)
            blocks.extend(computed)
            self._num_cached[request.request_id] = len(computed)
            self._num_freed[request.request_id] = len(computed) - len(plan.taken)

    def take_new(self, request: Request, num_new_tokens: int, plan: Allocation) -> None:
        """commit's second half: a copy of a shared block written into, and the new blocks."""
        bs, start = self.block_size, plan.start
        blocks = self.req_blocks[request.request_id]
        if plan.copy:
            self._changed(request.request_id, start // bs)
            self._copy_on_write(blocks, start // bs)
        if plan.needed > 0:
            self._changed(request.request_id, len(blocks))
            blocks.extend(self.pool.get_new_blocks(plan.needed, after=blocks[-1] if blocks else None))
        if self.debug:
            self._check_writable(blocks, start, num_new_tokens)

    def _free_behind_window(
        self, request_id: str, blocks: list[KVBlock], computed: Sequence[KVBlock], start: int
    ) -> list[KVBlock]:
        """With a sliding window: free the request's blocks that no query from position `start` on
        can see, and leave prefix hits there untaken (FREED in their place); returns the hits."""
        if self.sliding_window is None:
            return list(computed)
        first_seen = max(start - self.sliding_window + 1, 0) // self.block_size  # the first block still read
        done = self._num_freed.get(request_id, 0)
        for i in range(done, min(first_seen, len(blocks))):
            if blocks[i] is not FREED:
                self.pool.free_blocks([blocks[i]])
                blocks[i] = FREED
        if blocks:
            self._num_freed[request_id] = max(done, min(first_seen, len(blocks)))
        skip = min(max(first_seen - len(blocks), 0), len(computed))
        return [FREED] * skip + list(computed[skip:])

    def _shared_block_at(self, blocks: list[KVBlock], position: int) -> bool:
        index = position // self.block_size
        return index < len(blocks) and blocks[index].ref_cnt > 1

    def _copy_on_write(self, blocks: list[KVBlock], index: int) -> None:
        shared = blocks[index]
        (fresh,) = self.pool.get_new_blocks(1)
        self.copies.append((shared.block_id, fresh.block_id))
        self.pool.free_blocks([shared])
        blocks[index] = fresh

    def _check_writable(self, blocks: list[KVBlock], start: int, num_new: int) -> None:
        for block in blocks[start // self.block_size : cdiv(start + num_new, self.block_size)]:
            assert block.ref_cnt == 1, f"write into block {block.block_id} shared by {block.ref_cnt}"
            assert block.block_hash is None, f"write into cached block {block.block_id}"

    def trim(self, request: Request, lookahead: int = 0) -> None:
        """After rejected draft tokens were rolled back: free the blocks past the request's computed
        tokens and `lookahead` slots more (blocks that only rejected tokens had started filling;
        a draft model's K/V for its next proposals sits in the lookahead)."""
        blocks = self.req_blocks.get(request.request_id, [])
        keep = cdiv(request.num_computed_tokens + lookahead, self.block_size)
        if len(blocks) > keep:
            self.pool.free_blocks([b for b in reversed(blocks[keep:]) if b is not FREED])
            del blocks[keep:]
            self._num_freed[request.request_id] = min(self._num_freed.get(request.request_id, 0), keep)

    def _changed(self, request_id: str, index: int) -> None:
        """Entry `index` of the request's table is replaced or appended."""
        self._num_unchanged[request_id] = min(self._num_unchanged.get(request_id, index), index)

    def take_new_block_ids(self, request_id: str, whole: bool = False) -> tuple[int, list[int]]:
        """What a worker holding the request's table needs to catch up: how many of its leading
        entries still stand, and the block ids after them (`whole`: for a worker without the table,
        0 and all of them). From then on the table counts as known."""
        blocks = self.req_blocks.get(request_id, [])
        num_kept = self._num_unchanged.pop(request_id, len(blocks))
        if whole:
            num_kept = 0
        return num_kept, [b.block_id for b in blocks[num_kept:]]

    def take_other_group_block_ids(self, request_id: str, whole: bool = False) -> list[tuple[int, list[int]]]:
        """The other groups' take_new_block_ids (HybridKVCacheManager): none here, one group."""
        return []

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def fork(self, parent: Request, child: Request) -> None:
        """The child holds the parent's blocks too (one more reference each)."""
        blocks = self.req_blocks[parent.request_id]
        self.pool.touch([b for b in blocks if b is not FREED])
        self.req_blocks[child.request_id] = list(blocks)
        self._num_cached[child.request_id] = self._num_cached.get(parent.request_id, 0)
        self._num_freed[child.request_id] = self._num_freed.get(parent.request_id, 0)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """The blocks the request holds: its table's, less those freed behind its window."""
        return len(self.req_blocks.get(request_id, ())) - self._num_freed.get(request_id, 0)

    def free(self, request: Request) -> None:
        # Free the tail first: freed blocks are evicted in that order, so a shared prefix, which
        # later requests are likeliest to hit, stays cached longest.
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self._num_unchanged.pop(request.request_id, None)
        self._num_freed.pop(request.request_id, None)
        self.pool.free_blocks([b for b in reversed(blocks) if b is not FREED])

    def num_allocated_slots(self) -> int:
        return (
            sum(len(blocks) - self._num_freed.get(request_id, 0) for request_id, blocks in self.req_blocks.items())
            * self.block_size
        )

    def num_stored_tokens(self, request: Request) -> int:
        """Tokens of the request whose K/V its blocks hold (its computed ones less those freed
        behind the window)."""
        return max(request.num_computed_tokens - self._num_freed.get(request.request_id, 0) * self.block_size, 0)


def extend_block_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    root: Hashable,
    num_blocks: int,
    features: Sequence[MultiModalFeature] = (),
) -> list[int]:
    """The chained hashes of the first `num_blocks` full blocks of `token_ids`: `hashes` (those
    known so far) extended in place, the first `num_blocks` returned. A block that holds some of an
    image's placeholder tokens (all alike) also hashes the image's content and where in the block
    it starts: the same image hits, another one never does. Stable digests (digest.int_digest),
    not Python's hash(): a KV store on disk finds a block again after a restart."""
    while len(hashes) < num_blocks:
        i = len(hashes)
        start, end = i * block_size, (i + 1) * block_size
        parent = hashes[-1] if hashes else root_hash(root)
        tokens = array("q", token_ids[start:end]).tobytes()
        images = b"".join(
            f.identifier.to_bytes(8, "little") + (f.offset - start).to_bytes(8, "little", signed=True)
            for f in features
            if f.overlaps(start, end)
        )
        hashes.append(int_digest(parent.to_bytes(16, "little"), tokens, images))
    return hashes[:num_blocks]


def root_hash(root: Hashable) -> int:
    """The chain's start: the request's salt and adapter (plain values, whose repr is stable)."""
    return int_digest(b"pagedllm-root", repr(root).encode())


def group_hash(group: int, block_hash: int) -> int:
    """A block's key in a group past the first (the same tokens in other layers are another block)."""
    return int_digest(b"group", group.to_bytes(4, "little"), block_hash.to_bytes(16, "little"))
