"""Paged attention and the KV cache write as Triton kernels, for the GPU path: each query token of
a step, decode or a prefill chunk over its cached prefix, attends to its sequence's keys up to its
own position through the block table.

One program a (query token, KV head, context partition): the query heads of that KV head share
each tile of keys they read (GQA), as the rows of one tl.dot (padded to 16; in fp32, products of
bf16 values exact, as Triton's interpreter computes a bf16 dot wrongly); an online softmax
(running max and sum in fp32) walks the tiles; a sliding window's first key where one is set,
soft-capped scores (Gemma 2) or a sink logit a head (gpt-oss) where given. Keys go in partitions
of PARTITION, each its own softmax (max, sum, unnormalized output) folded into the ones before it
in order. A step of few tokens (decode) over a wide block table splits them: a program a partition,
and a second kernel folds them (flash-decoding) by the same operations, so a token's output has the
same bits split or not, whatever else its step holds (batch invariance). Whether a step splits
follows its tensors' shapes alone, so that a captured CUDA graph replays it. fp8 caches (e4m3, e5m2) are read as bytes
and widened times their scale, rounded once to q's dtype as the CPU kernels do.

The cache layout is the engine's: [blocks, block_size, kv_heads, head_dim] for K and V each. On the
CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before this module is
imported), which is how the tests hold them to `layers.attention.paged_attention_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Keys a partition of a split context holds, and the most tokens a step may have for its decode
# rows to be split (a prefill's tokens already give the device enough programs).
PARTITION = 512
SPLIT_MAX_TOKENS = 256
TILE = 16  # keys a loop step reads: tl.dot's smallest side

_FP8_KIND = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_FLOAT_CACHES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _load_cache(ptr, offsets, mask, FP8: tl.constexpr):
    """Cached values as fp32: fp8 bytes widened (1: e4m3, 2: e5m2), else the cache's float dtype."""
    if FP8 == 1:
        return tl.load(ptr + offsets, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif FP8 == 2:
        return tl.load(ptr + offsets, mask=mask, other=0).to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _partition(
    q,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq,
    kv_head,
    position,
    first,
    lo,
    hi,
    scale,
    k_scale,
    v_scale,
    softcap,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    q_ptr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
):
    """One partition's tiles lo..hi of keys (each with a valid key): its softmax's running max, sum
    and unnormalized output, [BLOCK_G] [BLOCK_G] [BLOCK_G, BLOCK_D], from scratch."""
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    keys = tl.arange(0, TILE)
    running_max = tl.full([BLOCK_G], -float("inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(lo, hi):
        key_position = tile * TILE + keys
        valid = (key_position <= position) & (key_position >= first)
        block = tl.load(block_tables_ptr + seq * stride_table + key_position // BLOCK_SIZE, mask=valid, other=0)
        offsets = (
            block.to(tl.int64)[:, None] * stride_cache_block
            + (key_position % BLOCK_SIZE)[:, None] * stride_cache_slot
            + kv_head * stride_cache_head
            + d[None, :]
        )
        kv_mask = valid[:, None] & d_valid[None, :]
        k = _load_cache(k_cache_ptr, offsets, kv_mask, FP8)
        if FP8 != 0:
            k = (k * k_scale).to(q_ptr.dtype.element_ty).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, TILE]
        if HAS_SOFTCAP:
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)  # softcap x tanh(scores / softcap)
        scores = tl.where(valid[None, :], scores, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(running_max - new_max)
        v = _load_cache(v_cache_ptr, offsets, kv_mask, FP8)
        if FP8 != 0:
            v = (v * v_scale).to(q_ptr.dtype.element_ty).to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision="ieee")
        running_sum = running_sum * rescale + tl.sum(weights, axis=1)
        running_max = new_max
    return running_max, running_sum, acc


@triton.jit
def _combine(total_max, total_sum, total_acc, part_max, part_sum, part_acc):
    """Fold a (non-empty) partition into the partitions before it: the one way both kernels fold."""
    top = tl.maximum(total_max, part_max)
    old = tl.exp(total_max - top)
    new = tl.exp(part_max - top)
    return top, total_sum * old + part_sum * new, total_acc * old[:, None] + part_acc * new[:, None]


@triton.jit
def _finish(total_max, total_sum, total_acc, sinks_ptr, heads, mask, HAS_SINKS: tl.constexpr):
    if HAS_SINKS:  # one more logit in the denominator, attending to nothing
        sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32)
        top = tl.maximum(total_max, sink)
        rescale = tl.exp(total_max - top)
        total_acc = total_acc * rescale[:, None]
        total_sum = total_sum * rescale + tl.exp(sink - top)
    return total_acc / total_sum[:, None]


@triton.jit
def _attention(
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    token_seq_ptr,
    sinks_ptr,
    scale,
    k_scale,
    v_scale,
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
    num_partitions,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION: tl.constexpr,
    TILE: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq = tl.load(token_seq_ptr + token)
    query_end = tl.load(query_start_loc_ptr + seq + 1)
    position = tl.load(seq_lens_ptr + seq) - (query_end - token)  # the last query token is the last key
    first = tl.where(sliding_window > 0, tl.maximum(position + 1 - sliding_window, 0), 0)  # (no branch: one type)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_valid = g < GROUP
    heads = kv_head * GROUP + g
    q_mask = g_valid[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + token * stride_q_token + heads[:, None] * stride_q_head + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32)
    # The partitions holding keys first..position, each folded in turn (split: this program's one).
    first_part = first // PARTITION
    last_part = position // PARTITION
    total_max = tl.full([BLOCK_G], -float("inf"), tl.float32)
    total_sum = tl.zeros([BLOCK_G], tl.float32)
    total_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if SPLIT:  # this program's partition alone, if it holds any of them
        first_part, last_part = tl.maximum(first_part, part), tl.minimum(last_part, part)
    for p in range(first_part, last_part + 1):
        lo = tl.maximum(first // TILE, p * (PARTITION // TILE))
        hi = tl.minimum(position // TILE + 1, (p + 1) * (PARTITION // TILE))
        part_max, part_sum, part_acc = _partition(
            q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, position, first, lo, hi, scale,
            k_scale, v_scale, softcap, stride_cache_block, stride_cache_slot, stride_cache_head, stride_table,
            q_ptr, BLOCK_SIZE, HEAD_DIM, BLOCK_G, BLOCK_D, TILE, HAS_SOFTCAP, FP8,
        )  # fmt: skip
        # (the first fold is exact: the partition's own max, sum and output, as the split stores them)
        total_max, total_sum, total_acc = _combine(total_max, total_sum, total_acc, part_max, part_sum, part_acc)
    if SPLIT:  # folded by _fold_partitions (an empty partition: max -inf, skipped there)
        at = (token * (GROUP * tl.num_programs(1)) + heads) * num_partitions + part
        tl.store(part_max_ptr + at, total_max, mask=g_valid)
        tl.store(part_sum_ptr + at, total_sum, mask=g_valid)
        tl.store(part_acc_ptr + at[:, None] * BLOCK_D + d[None, :], total_acc, mask=g_valid[:, None])
    else:
        out = _finish(total_max, total_sum, total_acc, sinks_ptr, heads, g_valid, HAS_SINKS)
        target = out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + d[None, :]
        tl.store(target, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _fold_partitions(
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    sinks_ptr,
    stride_out_token,
    stride_out_head,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One program a (token, query head): its partitions' parts folded in order, as the unsplit
    kernel folds them (the same operations: the same bits). Partitions past its position or before
    its window hold max -inf and are skipped, as that kernel never visits them."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    one = tl.arange(0, 1)
    d = tl.arange(0, BLOCK_D)
    total_max = tl.full([1], -float("inf"), tl.float32)
    total_sum = tl.zeros([1], tl.float32)
    total_acc = tl.zeros([1, BLOCK_D], tl.float32)
    for p in range(num_partitions):
        at = (token * tl.num_programs(1) + head) * num_partitions + p + one
        part_max = tl.load(part_max_ptr + at)
        if tl.max(part_max, axis=0) > -float("inf"):
            part_sum = tl.load(part_sum_ptr + at)
            part_acc = tl.load(part_acc_ptr + at[:, None] * BLOCK_D + d[None, :])
            total_max, total_sum, total_acc = _combine(total_max, total_sum, total_acc, part_max, part_sum, part_acc)
    out = _finish(total_max, total_sum, total_acc, sinks_ptr, head + one, one == 0, HAS_SINKS)
    target = out_ptr + token * stride_out_token + head * stride_out_head + (one[:, None] * 0 + d[None, :])
    tl.store(target, out.to(out_ptr.dtype.element_ty), mask=(d < HEAD_DIM)[None, :])


def cache_view(cache: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel is handed: an fp8 cache as its bytes (the kernels widen them)."""
    return cache.view(torch.uint8) if cache.dtype in _FP8_KIND else cache


def check_cache(cache: torch.Tensor) -> None:
    if (cache.dtype not in _FLOAT_CACHES and cache.dtype not in _FP8_KIND) or cache.stride(-1) != 1:
        raise ValueError(f"a {cache.dtype} cache: float or fp8, with its head dimension contiguous, expected")


def token_seqs(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each token's sequence index in the step (the engine builds it with the metadata)."""
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    seqs = torch.arange(len(query_lens), device=query_start_loc.device)
    return torch.repeat_interleave(seqs, query_lens, output_size=num_tokens)


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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    token_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [tokens, heads, head_dim] -> out of q's shape and dtype: each token over its sequence's
    cached keys up to its position (query_start_loc [seqs + 1], seq_lens [seqs], block_tables
    [seqs, max blocks]: the engine's attention metadata; `token_seq` [tokens], each token's
    sequence, made here where not given). Issues no host synchronization where `token_seq` is given."""
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or heads % kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit the caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    check_cache(k_cache)
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    token_seq = token_seqs(query_start_loc, tokens) if token_seq is None else token_seq
    q = q if q.stride(-1) == 1 else q.contiguous()
    group, block_d = heads // kv_heads, max(16, triton.next_power_of_2(head_dim))
    # The split follows the table's width (the longest context it can hold), never the lengths.
    num_partitions = triton.cdiv(block_tables.shape[1] * block_size, PARTITION)
    split = num_partitions > 1 and tokens <= SPLIT_MAX_TOKENS
    num_partitions = num_partitions if split else 1
    parts = [q.new_empty((tokens, heads, num_partitions), dtype=torch.float32) for _ in range(2)]
    accs = q.new_empty((tokens, heads, num_partitions, block_d), dtype=torch.float32) if split else parts[0]
    sinks_arg = sinks if sinks is not None else parts[0]  # (unread without sinks)
    _attention[(tokens, kv_heads, num_partitions)](
        out,
        parts[0],
        parts[1],
        accs,
        q,
        cache_view(k_cache),
        cache_view(v_cache),
        block_tables,
        query_start_loc,
        seq_lens,
        token_seq,
        sinks_arg,
        scale,
        k_scale,
        v_scale,
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
        num_partitions,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PARTITION=PARTITION,
        TILE=TILE,
        SPLIT=split,
        HAS_SOFTCAP=bool(softcap),
        HAS_SINKS=sinks is not None,
        FP8=_FP8_KIND.get(k_cache.dtype, 0),
        enable_fp_fusion=False,  # the two kernels' folds round alike only without fused multiply-adds
    )
    if split:
        _fold_partitions[(tokens, heads)](
            out,
            parts[0],
            parts[1],
            accs,
            sinks_arg,
            out.stride(0),
            out.stride(1),
            num_partitions,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            HAS_SINKS=sinks is not None,
            enable_fp_fusion=False,
        )
    return out


@triton.jit
def _write_kv(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    k_scale,
    v_scale,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < KV_HEADS) & (d < HEAD_DIM)
    target = (
        (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot + h * stride_cache_head + d
    )
    k = tl.load(k_ptr + token * stride_k_token + h * stride_k_head + d, mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + h * stride_v_head + d, mask=mask)
    if FP8 == 0:
        tl.store(k_cache_ptr + target, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + target, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(k_cache_ptr + target, _to_fp8(k.to(tl.float32) / k_scale, FP8), mask=mask)
        tl.store(v_cache_ptr + target, _to_fp8(v.to(tl.float32) / v_scale, FP8), mask=mask)


@triton.jit
def _to_fp8(x, FP8: tl.constexpr):
    """fp32 -> fp8 bytes (1: e4m3, 2: e5m2), saturated to the largest finite value, rounded to
    nearest even, as layers.attention.to_fp8 and the C++ kernels write them. The rounding is done
    here, exactly, in fp32 (value / the fp8 spacing at its exponent, a power of two), and only an
    exactly representable value is converted: Triton's interpreter rounds a value that carries into
    the next exponent to half of it."""
    if FP8 == 1:
        limit, mantissa_bits, min_exponent = 448.0, 3, -6
    else:
        limit, mantissa_bits, min_exponent = 57344.0, 2, -14
    x = tl.clamp(x, -limit, limit)
    magnitude = tl.abs(x)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    spacing = ((tl.maximum(exponent, min_exponent) - mantissa_bits + 127) << 23).to(tl.float32, bitcast=True)
    steps = magnitude / spacing  # exact
    whole = tl.floor(steps)
    half = steps - whole
    odd = (whole.to(tl.int32) & 1) == 1
    whole = tl.where((half > 0.5) | ((half == 0.5) & odd), whole + 1.0, whole)
    rounded = tl.where(x.to(tl.int32, bitcast=True) < 0, -whole * spacing, whole * spacing)  # -0.0 too
    if FP8 == 1:
        return rounded.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return rounded.to(tl.float8e5).to(tl.uint8, bitcast=True)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k, v [tokens, kv_heads, head_dim] (the last dimension contiguous) into the caches' slots
    (block x block_size + offset), in the caches' dtype (fp8: divided by
    the scale): as layers.attention.write_kv."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    if k.shape != v.shape or k.shape[1:] != (kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the caches {tuple(k_cache.shape)}")
    check_cache(k_cache)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if k.shape[0] == 0:
        return
    _write_kv[(k.shape[0],)](
        k,
        v,
        cache_view(k_cache),
        cache_view(v_cache),
        slot_mapping,
        k_scale,
        v_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=_FP8_KIND.get(k_cache.dtype, 0),
    )
