"""Paged attention: rotate this step's q and k, write its K/V into their slots, then attend
through the block tables. The cache holds the model's dtype, or fp8 (--kv-cache-dtype): bytes
of value / scale, with a K and a V scale per layer."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_ops, fused_ops_for
from pagedllm.layers.rotary import RopeTables, apply_rotary


@dataclass
class AttentionMetadata:
    """Where each of the step's tokens lives; built once per step by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    seq_lens_list: list[int]
    query_lens_list: list[int]
    # Models with several groups of layers (config.KVCacheGroups): groups 1..'s (slot_mapping,
    # block_tables); the fields above are group 0's.
    group_tables: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # Images whose tokens attend to each other both ways (Gemma 3), each wholly in this step: (the
    # sequence's index in the step, its first row, one past its last row).
    image_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # An encoder's token types, where a request of the step is a pair of texts (BERT's segments).
    token_types: torch.Tensor | None = None
    # [num_tokens]: each token's sequence, where a caller made it (a captured CUDA graph's static
    # buffer); the Triton kernel works it out from query_start_loc otherwise.
    token_seq: torch.Tensor | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of `group` attends with: its group's slots and block tables."""
        if group == 0:
            return self
        slot_mapping, block_tables = self.group_tables[group - 1]
        return dataclasses.replace(self, slot_mapping=slot_mapping, block_tables=block_tables, group_tables=[])


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# vLLM's VLLM_ATTENTION_BACKEND, ours: which kernels attend and write the KV cache. Unset: the C++
# kernels on the CPU (where built), the Triton kernels on a GPU; TORCH_SDPA: the torch reference
# anywhere; TRITON_ATTN: the Triton kernels anywhere (on the CPU, under TRITON_INTERPRET=1: tests).
BACKEND_ENV = "PAGEDLLM_ATTENTION_BACKEND"
BACKENDS = ("TRITON_ATTN", "TORCH_SDPA")


def attention_backend(device: torch.device) -> str:
    """ "cpu" (the C++ kernels), "triton" or "torch" for tensors on `device`; a ValueError names a
    backend that is not one (the engine asks once at start-up, check_attention_backend)."""
    chosen = os.environ.get(BACKEND_ENV, "")
    if chosen == "TRITON_ATTN":
        return "triton"
    if chosen == "TORCH_SDPA":
        return "torch"
    if chosen:
        raise ValueError(f"{BACKEND_ENV}={chosen!r}: choose from {', '.join(BACKENDS)}, or leave it unset")
    if device.type == "cpu":
        return "cpu" if cpu_ops() is not None else "torch"
    return "triton" if device.type == "cuda" else "torch"


def check_attention_backend(device: str) -> str:
    """The backend the engine's attention layers will take on `device`; a clear error at start-up
    for a bad choice, or Triton asked for where it is not installed."""
    backend = attention_backend(torch.device(device))
    if backend == "triton":
        try:
            import pagedllm.kernels.triton_attention  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"the Triton attention kernels need the triton package: {exc}") from exc
    return backend


def _triton():  # noqa: ANN202 (a module, imported where the backend is chosen)
    from pagedllm.kernels import triton_attention

    return triton_attention


@dataclass(frozen=True)
class KVScales:
    """A layer's fp8 cache scales: a cached K value is its fp8 value x k (V: x v)."""

    k: float = 1.0
    v: float = 1.0


def rotary_and_write_kv(
    qkv: torch.Tensor,
    rope: RopeTables,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    scales: KVScales = KVScales(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [num_tokens, (num_heads + 2 kv_heads) * head_dim], q then k then v. Applies rotary to
    q and k, writes k and v into their cache slots; returns q, k, v as [num_tokens, heads, head_dim]
    (views into qkv where the C++ kernel rotated them in place)."""
    tokens, (kv_heads, head_dim) = qkv.shape[0], k_cache.shape[2:]
    q, k, v = qkv.split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, num_heads, head_dim)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    backend = attention_backend(qkv.device)
    ops = fused_ops_for(qkv) if backend == "cpu" else None
    if ops is not None and qkv.stride(1) == 1:
        ops.rotary_and_cache(qkv, rope.cos, rope.sin, k_cache, v_cache, slot_mapping, num_heads, scales.k, scales.v)
        return q, k, v
    q, k = apply_rotary(q, rope), apply_rotary(k, rope)
    if backend == "triton":
        _triton().write_kv(k_cache, v_cache, k, v, slot_mapping, scales.k, scales.v)
    else:
        write_kv(k_cache, v_cache, k, v, slot_mapping, scales)
    return q, k, v


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: KVScales = KVScales(),
) -> None:
    write_rows(k_cache, k, slot_mapping, scales.k)
    write_rows(v_cache, v, slot_mapping, scales.v)


def write_rows(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor, scale: float = 1.0) -> None:
    """x [num_tokens, heads, head_dim] into the cache's slots (a latent cache's only write)."""
    rows = cache.view(-1, *cache.shape[2:])
    if cache.dtype in FP8_DTYPES:  # index_copy_ has no fp8 kernels: copy the bytes
        rows, x = rows.view(torch.uint8), to_fp8(x, cache.dtype, scale).view(torch.uint8)
    rows.index_copy_(0, slot_mapping, x.to(rows.dtype))


def to_fp8(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x / scale in an fp8 dtype, saturated to its largest finite value, rounded to nearest even
    (the C++ kernels write the same bytes)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def from_cache(cache: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cached values in `dtype`: fp8 bytes times the scale, rounded once to dtype, as the C++
    kernels widen them; a bf16 cache of fp32 values widened."""
    return (cache.float() * scale).to(dtype) if cache.dtype in FP8_DTYPES else cache.to(dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    scales: KVScales = KVScales(),
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> same shape; this step's keys and values are already
    in the cache, which the kernel reads for every token.

    Every query token attends by one fixed order of operations, whatever its step holds (a
    decode, a prefill chunk, a recompute, a verification), so outputs are batch- and
    cache-invariant. Attention sinks (gpt-oss: a learned logit per head in each softmax's
    denominator, `sinks` [num_heads]) the kernels take; scores soft-capped (Gemma 2:
    tanh(s / cap) * cap) go the torch reference's way on the CPU, the Triton kernel's elsewhere."""
    backend = attention_backend(q.device)
    where = (k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale)
    if backend == "triton":
        args = (sliding_window, softcap, sinks, scales.k, scales.v, meta.token_seq)
        return _triton().paged_attention(q, *where, *args)
    ops = cpu_ops() if backend == "cpu" else None
    if ops is None or softcap:
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, sliding_window, scales, softcap, sinks)
    out = torch.empty_like(q)
    sinks = None if sinks is None else sinks.detach().float().contiguous()
    ops.paged_attention(out, q.contiguous(), *where, sliding_window or 0, scales.k, scales.v, sinks)
    return out


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    scales: KVScales = KVScales(),
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch attention, one sequence at a time: the oracle for the kernel and its fallback."""
    outputs = []
    start = 0
    for b, (seq_len, q_len) in enumerate(zip(meta.seq_lens_list, meta.query_lens_list)):
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window:
            mask &= k_pos > q_pos - sliding_window
        rows = q[start : start + q_len]
        table = meta.block_tables[b]
        if sinks is not None or softcap:
            ks, vs = _gathered(k_cache, v_cache, table, seq_len, q.shape[1], q.dtype, scales)
            outputs.append(_attend_row_by_row(rows, ks, vs, seq_len - q_len, sliding_window, scale, sinks, softcap))
        else:
            outputs.append(_attend(rows, k_cache, v_cache, table, seq_len, mask, scale, scales, softcap))
        start += q_len
    return torch.cat(outputs, dim=0)


def _gathered(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_keys: int,
    num_heads: int,
    dtype: torch.dtype,
    scales: KVScales,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first `num_keys` cached keys and values in `dtype`, [num_heads, keys, head_dim]
    each (a KV head's repeated for its query heads)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    blocks = block_table[: -(-num_keys // block_size)].long()
    k = from_cache(k_cache[blocks], dtype, scales.k).reshape(-1, num_kv_heads, head_dim)[:num_keys]
    v = from_cache(v_cache[blocks], dtype, scales.v).reshape(-1, num_kv_heads, head_dim)[:num_keys]
    group = num_heads // num_kv_heads
    return k.transpose(0, 1).repeat_interleave(group, dim=0), v.transpose(0, 1).repeat_interleave(group, dim=0)


def _attend_row_by_row(
    q: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    first: int,
    sliding_window: int | None,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """q: [rows, heads, head_dim] at positions first, first + 1, ...; each row over its own keys
    (up to its position, within its window), its scores soft-capped (in q's dtype, as
    transformers' Gemma 2), or with one more logit a head, `sinks`, attending to nothing (in fp32,
    as gpt-oss). Row by row, each row's products of a shape its position alone sets: the same
    numbers whatever else its step holds (a product over a chunk's keys, the masked ones' zero
    probabilities among them, may order its sums otherwise)."""
    out = torch.empty_like(q)
    sink = None if sinks is None else sinks.to(torch.float)[:, None, None]
    for i in range(q.shape[0]):
        end = first + i + 1
        begin = max(0, end - sliding_window) if sliding_window else 0
        products = q[i][:, None, :] @ ks[:, begin:end].transpose(1, 2)  # [heads, 1, keys]
        if softcap:
            scores = torch.tanh(products * scale / softcap) * softcap
        else:
            scores = products.float() * scale
        if sink is not None:
            scores = torch.cat([scores.float(), sink], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float)
        if sink is not None:
            probs = probs[..., :-1]
        out[i] = (probs.to(vs.dtype) @ vs[:, begin:end])[:, 0]
    return out


def image_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    scales: KVScales = KVScales(),
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Over `out` (the causal attention's), each of meta.image_spans' rows attends as transformers'
    Gemma 3 has it: to every key up to its image's last token (those after it in the same image
    too), within its window. Each image is computed alone, whatever else its step holds. (No model
    with attention sinks takes images.)"""
    if sinks is not None:
        raise ValueError("image attention with attention sinks: no model has both")
    starts = meta.query_start_loc.tolist()
    for b, lo, hi in meta.image_spans:
        first = meta.seq_lens_list[b] - meta.query_lens_list[b]  # the position of the sequence's row starts[b]
        end = first + hi - starts[b]  # one past the image's last position: its keys' end
        mask = None
        if sliding_window:
            q_pos = torch.arange(first + lo - starts[b], end, device=q.device)[:, None]
            mask = torch.arange(end, device=q.device)[None, :] > q_pos - sliding_window
        out[lo:hi] = _attend(q[lo:hi], k_cache, v_cache, meta.block_tables[b], end, mask, scale, scales, softcap)


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_keys: int,
    mask: torch.Tensor | None,
    scale: float,
    scales: KVScales,
    softcap: float | None,
) -> torch.Tensor:
    """q: [rows, heads, head_dim] over a sequence's first `num_keys` cached keys where `mask`
    ([rows, num_keys]; None: all) allows -> [rows, heads, head_dim]."""
    ks, vs = _gathered(k_cache, v_cache, block_table, num_keys, q.shape[1], q.dtype, scales)
    qs = q.transpose(0, 1)  # [H, rows, D]
    if softcap:
        scores = torch.tanh(qs @ ks.transpose(1, 2) * scale / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1, dtype=torch.float).to(vs.dtype) @ vs
    else:
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)
