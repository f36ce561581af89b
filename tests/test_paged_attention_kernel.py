"""The C++ paged-attention kernel against the pure-torch reference."""

from __future__ import annotations

import functools

import pytest
import torch

from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import AttentionMetadata, KVScales, paged_attention, paged_attention_reference


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
    # Decodes (q_len 1), whole prefills, and a prefill chunk on cached context.
    q, k, v, meta = _case(
        seq_lens=[1, 37, 200, 64, 9],
        query_lens=[1, 1, 200, 20, 9],
        block_size=block_size,
        dtype=dtype,
        head_dim=head_dim,
        heads=heads,
        kv_heads=kv_heads,
    )
    scale = head_dim**-0.5
    got = paged_attention(q, k, v, meta, scale, window)
    want = paged_attention_reference(q.float(), k.float(), v.float(), meta, scale, window)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def _decode_at(meta: AttentionMetadata, b: int, pos: int) -> AttentionMetadata:
    """Sequence b's decode alone at position pos (its context pos + 1 tokens)."""
    return AttentionMetadata(
        meta.slot_mapping,
        meta.block_tables[b : b + 1],
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([pos + 1], dtype=torch.int32),
        [pos + 1],
        [1],
    )


def _run_kernel(q, k, v, meta, window: int = 0, kv_scales=(1.0, 1.0), sinks=None) -> torch.Tensor:
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
        *kv_scales,
        sinks,
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
        (64, 4, 2, [33, 120], [11, 2]),  # a run longer than one walk takes (8 tokens)
        (64, 4, 2, [250, 90, 1], [250, 40, 1]),  # a whole prompt, a chunk on cached context, a decode
        (128, 8, 2, [170], [170]),
        (64, 9, 3, [1100], [9]),  # a verification past several partitions of the context (256 tokens)
        (64, 4, 2, [700, 600, 1], [1, 300, 1]),  # decodes and a chunk, the chunk's tokens across partitions
    ],
)
@pytest.mark.parametrize(
    "dtype, cache", [("bf16", "bf16"), ("bf16", "fp8"), ("fp32", "fp32"), ("fp32", "fp8"), ("fp32", "bf16")]
)
@pytest.mark.parametrize("window", [0, 50, 400])  # 50: the runs' tokens start apart, each walks alone
def test_every_query_token_is_its_decode(head_dim, heads, kv_heads, seq_lens, query_lens, dtype, cache, window):
    """Batch invariance: each query row of a step, whatever the step (a prefill chunk of any size, a
    whole prompt, a verification's run, beside other sequences), is bit for bit the row a decode
    step at that position computes alone."""
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    q, k, v, meta = _case(
        seq_lens, query_lens, block_size=16, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=torch_dtype
    )
    scales = (1.0, 1.0)
    if cache == "fp8":
        k, v, scales = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), (0.5, 2.0)
    elif cache != dtype:
        k, v = k.bfloat16(), v.bfloat16()
    run = functools.partial(_run_kernel, window=window, kv_scales=scales)
    together = run(q, k, v, meta)
    row = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        for t in range(q_len):
            decode = _decode_at(meta, b, seq_len - q_len + t)
            assert torch.equal(together[row], run(q[row : row + 1].contiguous(), k, v, decode)[0]), (b, t)
            row += 1


def _decode_batch(seq_lens, block_size, dtype=torch.float32, heads=9, kv_heads=3, head_dim=64, cache=None):
    q, k, v, meta = _case(seq_lens, [1] * len(seq_lens), block_size, heads, kv_heads, head_dim, dtype)
    scales = (1.0, 1.0)
    if cache is not None:
        k, v, scales = k.to(cache), v.to(cache), (0.5, 2.0)
    return q, k, v, meta, scales


@pytest.mark.skipif(cpu_ops() is None, reason="no C++ toolchain")
@pytest.mark.parametrize("block_size", [1, 16, 48])  # 48: partitions of 288 tokens (256 rounded up to blocks)
@pytest.mark.parametrize("cache", [None, torch.float8_e5m2])
def test_long_decodes_same_bits_on_any_threads(block_size, cache):
    """A long context is cut into partitions that threads may share out (a few decodes) or walk whole
    (many): the bits are the same on 1, 2 or 3 threads and alone or beside 31 other decodes."""
    q, k, v, meta, scales = _decode_batch([1500, 700, 300, 40] * 8, block_size, cache=cache)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(_run_kernel(q, k, v, meta, kv_scales=scales))
            alone = [
                _run_kernel(q[b : b + 1].contiguous(), k, v, _one_seq(meta, b), kv_scales=scales)[0] for b in range(4)
            ]
            assert all(torch.equal(runs[-1][b], alone[b]) for b in range(4)), n
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    want = paged_attention_reference(q, k, v, meta, 64**-0.5, None, KVScales(*scales))
    torch.testing.assert_close(runs[0], want, atol=1e-5, rtol=1e-5)


def _one_seq(meta: AttentionMetadata, b: int) -> AttentionMetadata:
    return _decode_at(meta, b, int(meta.seq_lens[b]) - 1)


@pytest.mark.skipif(cpu_ops() is None, reason="no C++ toolchain")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 300])
def test_long_context_matches_reference(dtype, tol, window):
    """Contexts of several partitions, a whole prompt among them, against the torch reference."""
    q, k, v, meta = _case([1300, 600, 777], [1, 600, 5], 16, 9, 3, 64, dtype)
    got = paged_attention(q, k, v, meta, 0.125, window)
    want = paged_attention_reference(q.float(), k.float(), v.float(), meta, 0.125, window)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(cpu_ops() is None, reason="no C++ toolchain")
@pytest.mark.parametrize(
    "dtype, heads, kv_heads, head_dim, block_size",
    [
        (torch.float32, 12, 1, 64, 16),  # 12 query heads a KV head: a row block of one token
        (torch.float32, 10, 2, 64, 16),  # groups of 5
        (torch.float32, 4, 2, 64, 512),  # blocks longer than a partition: partitions of one block
        (torch.float32, 4, 2, 40, 16),  # rows widened into the walk's width of 48
        (torch.float16, 4, 2, 64, 16),  # fp16 rows widened a block at a time
    ],
)
def test_walk_shapes_are_their_decodes_and_the_reference(dtype, heads, kv_heads, head_dim, block_size):
    """Shapes the walk splits or pads, across partitions: each row of a chunk and a whole prompt
    is bit for bit its decode alone, and the rows match the torch reference."""
    seq_lens, query_lens = [1100, 700], [6, 300]
    q, k, v, meta = _case(seq_lens, query_lens, block_size, heads, kv_heads, head_dim, dtype)
    together = _run_kernel(q, k, v, meta)
    row = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        for t in range(0, q_len, 7):  # every seventh row, its decode alone
            pos = seq_len - q_len + t
            decode = _decode_at(meta, b, pos)
            assert torch.equal(together[row + t], _run_kernel(q[row + t : row + t + 1].contiguous(), k, v, decode)[0])
        row += q_len
    want = paged_attention_reference(q.float(), k.float(), v.float(), meta, head_dim**-0.5, None)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(together.float(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(cpu_ops() is None, reason="no C++ toolchain")
@pytest.mark.parametrize(
    "dtype, cache, head_dim, heads, kv_heads",
    [
        ("bf16", "bf16", 64, 8, 2),  # the AVX-512 BF16 walk
        ("bf16", "bf16", 128, 8, 1),
        ("bf16", "fp8", 64, 4, 2),
        ("fp32", "fp32", 64, 9, 3),  # attention_walk.h's walk, the long decode split by partitions
        ("fp32", "fp8", 32, 4, 2),
        ("fp32", "bf16", 64, 4, 1),
    ],
)
@pytest.mark.parametrize("window", [0, 50])
def test_sinks_match_reference_and_decodes(dtype, cache, head_dim, heads, kv_heads, window):
    """Attention sinks (gpt-oss: a logit per query head in each softmax's denominator): the kernel's
    rows match the torch reference, differ from the rows without sinks, and each row of a step is
    bit for bit its decode alone."""
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    seq_lens, query_lens = [1300, 300, 77, 1], [1, 300, 5, 1]
    q, k, v, meta = _case(seq_lens, query_lens, 16, heads, kv_heads, head_dim, torch_dtype, seed=3)
    scales = (1.0, 1.0)
    if cache == "fp8":
        k, v, scales = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), (0.5, 2.0)
    elif cache != dtype:
        k, v = k.bfloat16(), v.bfloat16()
    # Sinks around the scores' own size and above them, so that they take a real share.
    sinks = torch.linspace(-2.0, 4.0, heads, dtype=torch.float32)
    got = _run_kernel(q, k, v, meta, window, scales, sinks)
    want = paged_attention_reference(
        q.float(), k, v, meta, head_dim**-0.5, window or None, KVScales(*scales), sinks=sinks
    )
    tol = 1e-5 if dtype == "fp32" else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    without = _run_kernel(q, k, v, meta, window, scales)
    assert (without.float() - want).abs().max() > 20 * tol
    row = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        for t in range(0, q_len, 11):
            pos = seq_len - q_len + t
            decode = _decode_at(meta, b, pos)
            alone = _run_kernel(q[row + t : row + t + 1].contiguous(), k, v, decode, window, scales, sinks)
            assert torch.equal(got[row + t], alone[0]), (b, t)
        row += q_len
