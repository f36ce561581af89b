"""glibc's heap, set for what pagedllm allocates: while loading, blocks of 1 MiB or more mapped on
their own (the load's temporaries leave no free room in the heap); once loaded, a step's
temporaries reused from the heap step after step, and its free pages handed back after long
steps. The KV cache on huge pages where Linux gives them on request. Elsewhere than glibc, nothing."""

from __future__ import annotations

import ctypes

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_MMAP_THRESHOLD_BYTES = 1 << 20  # while loading
_STEP_MMAP_THRESHOLD_BYTES, _STEP_TRIM_THRESHOLD_BYTES = 16 << 20, 32 << 20  # once loaded
_MADV_HUGEPAGE, _PAGE_BYTES = 14, 4096  # Linux's madvise advice; its base page

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
    _libc.malloc_trim  # noqa: B018 (raises where this C library has none)
except (OSError, AttributeError):
    _libc = None


def map_large_blocks() -> None:
    """While loading, map every block of 1 MiB or more on its own, so that freeing it hands it back.
    Otherwise glibc raises its threshold to the largest block freed (up to 32 MiB) and serves such
    blocks from the heap: packing quantized weights allocates and frees about the model's size in
    temporaries, which leave that much free room in the heap (trimmed, but still free room). glibc
    serves blocks of any size from free room before mapping new ones, so a long step's temporaries
    landed there and stayed resident once freed (the 250M Q4_K_M model under 64 requests: 1037-1078
    MiB at most against 1008-1016 with this)."""
    if _libc is not None:
        _libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)


def keep_step_blocks() -> None:
    """Once loaded: blocks under 16 MiB from the heap, and up to 32 MiB free at its top kept for the
    next step. A step's temporaries (a decode's logits at batch 64: 8 MiB) are then reused step
    after step, instead of a page fault per 4 KiB and an unmap per block each time (the bf16 250M
    model under 64 requests: 443-449 output tok/s against 414). The trim after long steps (trim)
    hands back what a prefill left."""
    if _libc is not None:
        _libc.mallopt(_M_MMAP_THRESHOLD, _STEP_MMAP_THRESHOLD_BYTES)
        _libc.mallopt(_M_TRIM_THRESHOLD, _STEP_TRIM_THRESHOLD_BYTES)


def trim() -> None:
    """Hand the heap's free pages back to the OS (about 1 ms): after loading, and after a long step,
    whose smaller temporaries stay resident in the heap once freed."""
    if _libc is not None:
        _libc.malloc_trim(0)


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A KV cache tensor of zeros. On CPU its memory is advised as huge pages before it is first
    touched (Linux's transparent huge pages, which many systems give only to memory so advised), so
    that reading a long context's K/V, block after block, takes far fewer TLB misses: 2 MiB a page
    against 4 KiB (docs/benchmarks-history.md, issue 45's sixth session). Where the advice is refused
    (other systems, huge pages off), ordinary pages."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    nbytes = tensor.numel() * tensor.element_size()
    if _libc is not None and tensor.device.type == "cpu" and nbytes > 0:
        start = -(-tensor.data_ptr() // _PAGE_BYTES) * _PAGE_BYTES  # madvise takes whole pages
        end = tensor.data_ptr() + nbytes
        if end > start:
            _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    return tensor.zero_()
