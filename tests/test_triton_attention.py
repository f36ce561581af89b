"""The GPU path's Triton paged attention (kernels/triton_attention.py), run on the CPU under Triton's
interpreter, against the torch reference the C++ kernel is held to: decode rows and prefill chunks
over cached prefixes in one step, grouped-query heads, sliding windows, soft-capped scores and
attention sinks, a head size that is not a power of two."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from pagedllm.layers.attention import paged_attention_reference

# Triton decides at its own import whether @triton.jit interprets (its library's functions too), so
# the kernel's checks run in a process of their own, started with TRITON_INTERPRET=1 by the first test.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_the_interpreter = pytest.mark.skipif(not INTERPRETED, reason="run by test_kernels_under_the_interpreter's process")


def test_kernels_under_the_interpreter():
    if INTERPRETED:
        pytest.skip("this is that process")
    pytest.importorskip("triton")
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and " failed" not in child.stdout, child.stdout[-2000:]


@pytest.fixture(scope="module")
def kernel():
    from pagedllm.kernels import triton_attention

    return triton_attention


def _step(seq_lens: list[int], query_lens: list[int], heads: int, kv_heads: int, head_dim: int, seed: int):
    """A step's q, caches (blocks of 8 handed out shuffled) and metadata, and the reference's view of them."""
    g = torch.Generator().manual_seed(seed)
    block_size = 8
    tables = []
    next_block = 0
    for seq_len in seq_lens:
        count = -(-seq_len // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    order = torch.randperm(next_block, generator=g).tolist()  # blocks anywhere in the cache
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([[order[b] for b in t] + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache = torch.randn(next_block, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(next_block, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = SimpleNamespace(seq_lens_list=seq_lens, query_lens_list=query_lens, block_tables=block_tables)
    return q, k_cache, v_cache, block_tables, starts, torch.tensor(seq_lens, dtype=torch.int32), meta


# A decode row, a prefill chunk over a cached prefix, a whole prompt, a decode deep in its sequence.
_SEQ_LENS, _QUERY_LENS = [9, 21, 6, 40], [1, 7, 6, 1]


@in_the_interpreter
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "window", "softcap", "sinks"),
    [
        (4, 2, 16, None, None, False),
        (4, 1, 24, None, None, False),  # head size padded to 32 lanes
        (2, 2, 16, 5, None, False),
        (4, 2, 16, None, 3.0, False),
        (4, 2, 16, 6, None, True),
    ],
)
def test_triton_attention_equals_the_reference(kernel, heads, kv_heads, head_dim, window, softcap, sinks):
    q, k_cache, v_cache, tables, starts, lens, meta = _step(_SEQ_LENS, _QUERY_LENS, heads, kv_heads, head_dim, seed=1)
    sink_logits = torch.randn(heads, generator=torch.Generator().manual_seed(2)) if sinks else None
    scale = head_dim**-0.5
    out = kernel.paged_attention(q, k_cache, v_cache, tables, starts, lens, scale, window, softcap, sink_logits)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, scale, window, softcap=softcap, sinks=sink_logits)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@in_the_interpreter
def test_triton_attention_reads_its_own_sequence(kernel):
    """Swapping two sequences' block tables changes only their rows: a kernel reading the wrong
    table, position or KV head would not pass the test above by chance, and this one says which."""
    q, k_cache, v_cache, tables, starts, lens, meta = _step([16, 16], [1, 1], 2, 1, 16, seed=3)
    out = kernel.paged_attention(q, k_cache, v_cache, tables, starts, lens, 0.25)
    swapped = kernel.paged_attention(q, k_cache, v_cache, tables.flip(0).contiguous(), starts, lens, 0.25)
    assert not torch.allclose(out, swapped)
    meta.block_tables = tables.flip(0)
    torch.testing.assert_close(swapped, paged_attention_reference(q, k_cache, v_cache, meta, 0.25, None))


@in_the_interpreter
def test_triton_attention_refuses_mismatched_shapes(kernel):
    q, k_cache, v_cache, tables, starts, lens, _ = _step([4], [4], 4, 2, 16, seed=4)
    with pytest.raises(ValueError, match="does not fit"):
        kernel.paged_attention(q[..., :8], k_cache, v_cache, tables, starts, lens, 0.25)


@in_the_interpreter
def test_triton_attention_in_bf16(kernel):
    """bf16 queries and caches (the GPU's dtype): fp32 inside, one rounding at the store, so within
    a bf16 step of the reference computed in fp32 on the same values."""
    q, k_cache, v_cache, tables, starts, lens, meta = _step(_SEQ_LENS, _QUERY_LENS, 4, 2, 16, seed=5)
    q, k_cache, v_cache = (t.bfloat16() for t in (q, k_cache, v_cache))
    out = kernel.paged_attention(q, k_cache, v_cache, tables, starts, lens, 0.25)
    expected = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.25, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=2**-7)


@in_the_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kv_write_equals_the_torch_write(kernel, dtype):
    """Tokens' K and V (3 KV heads, head size 24: both padded) into scattered slots of a cache of
    their dtype (the GPU's bf16 too), as the torch path writes them; the other slots untouched."""
    from pagedllm.layers.attention import write_kv

    g = torch.Generator().manual_seed(6)
    k, v = (torch.randn(5, 3, 24, generator=g).to(dtype) for _ in range(2))
    slots = torch.tensor([17, 3, 30, 8, 0])
    k_cache, v_cache = (torch.randn(4, 8, 3, 24, generator=g).to(dtype) for _ in range(2))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv(expected_k, expected_v, k, v, slots)
    kernel.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
