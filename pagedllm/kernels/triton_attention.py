"""Paged attention and the KV cache write as Triton kernels, for the GPU path (issue 51): each query token of a step,
decode or a prefill chunk over its cached prefix, attends to its sequence's keys up to its own
position through the block table, for every head at once of a program's (token, query head).

One program a (query token, query head): the keys of its KV head (query head // group), a cache
block a loop step, in an online softmax (running max and sum in fp32), a sliding window's first
key where one is set, soft-capped scores (Gemma 2) or a sink logit a head (gpt-oss) where given.
The cache layout is the engine's: [blocks, block_size, kv_heads, head_dim] for K and V each.

On the CPU the same kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before this
module is imported), which is how the tests hold it to `layers.attention.paged_attention_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    seq_of_token_ptr,
    sinks_ptr,
    scale,
    softcap,
    sliding_window,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_of_token_ptr + token)
    query_end = tl.load(query_start_loc_ptr + seq + 1)
    position = tl.load(seq_lens_ptr + seq) - (query_end - token)  # the last query token is the last key
    first = 0
    if sliding_window > 0:
        first = tl.maximum(position + 1 - sliding_window, 0)
    kv_head = head // GROUP
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q = tl.load(q_ptr + token * stride_q_token + head * stride_q_head + d, mask=d_valid, other=0.0).to(tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    running_max = -float("inf")
    running_sum = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for index in range(first // BLOCK_SIZE, position // BLOCK_SIZE + 1):
        block = tl.load(block_tables_ptr + seq * stride_table + index).to(tl.int64)
        key_position = index * BLOCK_SIZE + slots
        valid = (key_position <= position) & (key_position >= first)
        offsets = block * stride_cache_block + slots[:, None] * stride_cache_slot + kv_head * stride_cache_head
        mask = valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + offsets + d[None, :], mask=mask, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        if HAS_SOFTCAP:
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)  # softcap x tanh(scores / softcap)
        scores = tl.where(valid, scores, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        weights = tl.exp(scores - new_max)
        rescale = tl.exp(running_max - new_max)
        v = tl.load(v_cache_ptr + offsets + d[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
        running_sum = running_sum * rescale + tl.sum(weights, axis=0)
        running_max = new_max
    if HAS_SINKS:  # one more logit in the denominator, attending to nothing
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        new_max = tl.maximum(running_max, sink)
        rescale = tl.exp(running_max - new_max)
        acc = acc * rescale
        running_sum = running_sum * rescale + tl.exp(sink - new_max)
    out = acc / running_sum
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [tokens, heads, head_dim] -> out of q's shape and dtype: each token over its sequence's
    cached keys up to its position (query_start_loc [seqs + 1], seq_lens [seqs], block_tables
    [seqs, max blocks]: the engine's attention metadata)."""
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or heads % kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit the caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k_cache.dtype not in (torch.float32, torch.bfloat16, torch.float16) or k_cache.stride(-1) != 1:
        raise ValueError(f"a {k_cache.dtype} cache with its head dimension contiguous expected")
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens), device=q.device), query_lens)
    q = q if q.stride(-1) == 1 else q.contiguous()
    _paged_attention[(tokens, heads)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        seq_of_token,
        sinks if sinks is not None else q,  # (unread without sinks)
        scale,
        softcap or 0.0,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=heads // kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_SOFTCAP=bool(softcap),
        HAS_SINKS=sinks is not None,
    )
    return out


@triton.jit
def _write_kv(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_token,
    stride_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < KV_HEADS) & (d < HEAD_DIM)
    source = token * stride_token + h * stride_head + d
    target = (
        (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot + h * stride_cache_head + d
    )
    k = tl.load(k_ptr + source, mask=mask)
    v = tl.load(v_ptr + source, mask=mask)
    tl.store(k_cache_ptr + target, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + target, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [tokens, kv_heads, head_dim] into the caches' slots (block x block_size + offset), in the
    caches' dtype: as layers.attention.write_kv, for caches of a float dtype."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    if k.shape != v.shape or k.shape[1:] != (kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the caches {tuple(k_cache.shape)}")
    if k_cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"a {k_cache.dtype} cache: the Triton write takes float caches")
    k, v = k.contiguous(), v.contiguous()
    if k.shape[0] == 0:
        return
    _write_kv[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
