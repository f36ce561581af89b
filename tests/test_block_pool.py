"""BlockPool's placement: a growing request's blocks side by side, cached blocks in eviction order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.block_pool import SET_ASIDE, BlockPool, KVBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def _grow(pool: BlockPool, tables: list[list[KVBlock]], who: int, n: int) -> None:
    table = tables[who]
    table.extend(pool.get_new_blocks(n, after=table[-1] if table else None))


def test_requests_growing_in_turn_keep_their_blocks_in_runs():
    pool = BlockPool(200)
    tables: list[list[KVBlock]] = [[], [], []]
    for who, n in ((0, 3), (1, 2), (2, 4)):  # prompts, one after another
        _grow(pool, tables, who, n)
    for _ in range(8):  # decodes: each request a block per round, in turn
        for who in range(3):
            _grow(pool, tables, who, 1)
    for table in tables:
        ids = [b.block_id for b in table]
        assert ids == list(range(ids[0], ids[0] + len(ids)))
    assert len({b.block_id for t in tables for b in t}) == sum(len(t) for t in tables)


def test_decoding_requests_grow_in_runs_through_the_cache_manager():
    kv = KVCacheManager(100, block_size=4, enable_prefix_caching=False)
    requests = [Request(f"r{i}", [1] * n, SamplingParams(max_tokens=40), 40, frozenset()) for i, n in enumerate((6, 9))]
    for request in requests:  # prefill
        assert kv.allocate_slots(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
    for _ in range(20):  # decodes in turn, a token each
        for request in requests:
            assert kv.allocate_slots(request, 1)
            request.num_computed_tokens += 1
    for request in requests:
        ids = kv.block_ids(request.request_id)
        assert len(ids) == -(-request.num_computed_tokens // 4) and ids == list(range(ids[0], ids[0] + len(ids)))


def test_set_aside_blocks_go_to_others_last():
    assert SET_ASIDE > 0
    pool = BlockPool(20)
    first = pool.get_new_blocks(2)  # 0, 1: blocks 2 .. 1 + SET_ASIDE are set aside
    other = pool.get_new_blocks(20 - 2 - SET_ASIDE)
    assert [b.block_id for b in first] == [0, 1]
    assert [b.block_id for b in other] == list(range(2 + SET_ASIDE, 20))
    assert [b.block_id for b in pool.get_new_blocks(SET_ASIDE)] == list(range(2, 2 + SET_ASIDE))


def test_a_cached_block_is_not_taken_out_of_its_turn():
    pool = BlockPool(10)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(b, block_hash=123)
    pool.free_blocks([b])
    (c,) = pool.get_new_blocks(1, after=a)  # b follows a, but holds a cached prefix
    assert c is not b and pool.lookup(123) is b


# A random sequence of operations on a small pool: ("grow", table, n), ("free", table), ("cache", table).
op_st = st.one_of(
    st.tuples(st.just("grow"), st.integers(0, 3), st.integers(1, 3)),
    st.tuples(st.just("free"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("cache"), st.integers(0, 3), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(st.integers(4, 40), st.lists(op_st, max_size=60))
def test_placement_keeps_the_accounting_and_the_eviction_order(num_blocks, ops):
    pool = BlockPool(num_blocks)
    tables: list[list[KVBlock]] = [[] for _ in range(4)]
    freed_cached: list[int] = []  # cached blocks in the order they were freed: their eviction order
    next_hash = 0
    for op, who, n in ops:
        if op == "grow" and n <= pool.num_free_blocks:
            before = set(pool._free)
            _grow(pool, tables, who, n)
            assert {b.block_id for b in tables[who][-n:]} <= before
            freed_cached = [i for i in freed_cached if pool.blocks[i].block_hash is not None and i in pool._free]
        elif op == "free":
            for block in reversed(tables[who]):
                if block.block_hash is not None:
                    freed_cached.append(block.block_id)
            pool.free_blocks(list(reversed(tables[who])))
            tables[who] = []
        elif op == "cache":
            for block in tables[who]:
                next_hash += 1
                pool.cache_block(block, next_hash)
        held = [b.block_id for t in tables for b in t]
        assert len(held) == len(set(held))  # no block held twice
        for block in pool.blocks:
            assert (block.block_id in pool._free) == (block.ref_cnt == 0)
            assert block.ref_cnt == held.count(block.block_id)
        queue_cached = [i for i in pool._free if pool.blocks[i].block_hash is not None]
        assert queue_cached == freed_cached  # set-asides never reorder cached blocks
