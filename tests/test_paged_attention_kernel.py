"""The C++ paged-attention kernel against the pure-torch reference."""

from __future__ import annotations

import functools

import pytest
import torch

from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import AttentionMetadata, paged_attention, paged_attention_reference


def _case(seq_lens, query_lens, block_size, heads=4, kv_heads=2, head_dim=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()  # scattered, out-of-order blocks
    width = max(blocks_per_seq)
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(order[used : used + n] + [0] * (width - n))
        used += n
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    q = torch.randn(starts[-1], heads, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata(
        torch.zeros(0, dtype=torch.long),
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        list(seq_lens),
        list(query_lens),
    )
    return q, k_cache, v_cache, meta


def _gather(cache: torch.Tensor, meta: AttentionMetadata, b: int, seq_len: int, q_len: int) -> torch.Tensor:
    blocks = meta.block_tables[b, : -(-seq_len // cache.shape[1])].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[seq_len - q_len : seq_len]


@pytest.mark.skipif(cpu_ops() is None, reason="no C++ toolchain")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("head_dim", [32, 64, 128])  # 64 and 128 have their own compiled paths
# Groups of 2, 3, 4 and 5 (5: one head a call); bf16 with head size 64 or 128 takes the AVX-512 path.
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (9, 3), (8, 2), (5, 1)])
def test_kernel_matches_reference(dtype, tol, block_size, window, head_dim, heads, kv_heads):
    # Decodes (q_len 1), whole prefills (the fused path), and a prefill chunk on cached context.
    q, k, v, meta = _case(
        seq_lens=[1, 37, 200, 64, 9],
        query_lens=[1, 1, 200, 20, 9],
        block_size=block_size,
        dtype=dtype,
        head_dim=head_dim,
        heads=heads,
        kv_heads=kv_heads,
    )
    # This step's K/V of each sequence, as the model passes them (the fresh prompt's own keys).
    lens = list(enumerate(zip(meta.seq_lens_list, meta.query_lens_list)))
    fresh_k = torch.cat([_gather(k, meta, b, n, q_len) for b, (n, q_len) in lens])
    fresh_v = torch.cat([_gather(v, meta, b, n, q_len) for b, (n, q_len) in lens])
    scale = head_dim**-0.5
    got = paged_attention(q, fresh_k, fresh_v, k, v, meta, scale, window)
    want = paged_attention_reference(q.float(), k.float(), v.float(), meta, scale, window)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def _run_kernel(q, k, v, meta, walk_max_q: int, window: int = 0, kv_scales=(1.0, 1.0)) -> torch.Tensor:
    out = torch.empty_like(q)
    cpu_ops().paged_attention(
        out,
        q,
        k,
        v,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        q.shape[-1] ** -0.5,
        window,
        False,
        walk_max_q,
        *kv_scales,
    )
    return out


@pytest.mark.skipif(cpu_ops() is None, reason="no C++ toolchain")
@pytest.mark.parametrize(
    "head_dim, heads, kv_heads, seq_lens, query_lens",
    [
        (64, 4, 2, [40, 77, 130], [5, 3, 5]),
        (128, 8, 1, [40, 77, 130], [5, 3, 5]),
        (32, 4, 2, [40, 77, 130], [5, 3, 5]),
        (64, 9, 3, [300], [7]),  # the default model's heads at batch 1: the run's walks split its tokens
        (64, 4, 2, [33, 120], [11, 2]),
    ],
)  # a run longer than one walk takes (8 tokens)
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("window", [0, 50, 400])  # 50: the runs' tokens start apart, each walks alone
def test_short_query_runs_compute_what_decodes_would(head_dim, heads, kv_heads, seq_lens, query_lens, cache, window):
    """A speculative verification's k + 1 query tokens (walk_max_q) attend as decodes do, walking
    their context together: each row is bit for bit the one a decode step at that position
    computes; the query tiles, which longer runs take, round otherwise (bf16, head sizes 64 and 128)."""
    q, k, v, meta = _case(
        seq_lens, query_lens, block_size=16, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16
    )
    scales = (1.0, 1.0)
    if cache == "fp8":
        k, v, scales = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), (0.5, 2.0)
    run = functools.partial(_run_kernel, window=window, kv_scales=scales)
    walked, tiled = run(q, k, v, meta, walk_max_q=max(query_lens)), run(q, k, v, meta, walk_max_q=1)
    row = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        for t in range(q_len):
            decode = AttentionMetadata(
                meta.slot_mapping,
                meta.block_tables[b : b + 1],
                torch.tensor([0, 1], dtype=torch.int32),
                torch.tensor([seq_len - q_len + t + 1], dtype=torch.int32),
                [seq_len - q_len + t + 1],
                [1],
            )
            assert torch.equal(walked[row], run(q[row : row + 1].contiguous(), k, v, decode, walk_max_q=1)[0])
            row += 1
    torch.testing.assert_close(walked.float(), tiled.float(), atol=2e-2, rtol=2e-2)
    tiles = cpu_ops().attention_has_query_tiles(head_dim, heads // kv_heads)  # AVX512-BF16 only
    if tiles and cache == "bf16" and window == 0:  # the tiles' own order of sums: why verification needs the walks
        assert not torch.equal(walked, tiled)
