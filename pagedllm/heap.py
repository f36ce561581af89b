"""glibc's heap kept from holding freed temporaries: blocks of 1 MiB or more mapped on their own
from the start of loading, and the heap's free pages handed back after loading and after long
steps. Elsewhere than glibc, nothing."""
from __future__ import annotations

import ctypes

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MMAP_THRESHOLD_BYTES = 1 << 20

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
    _libc.malloc_trim  # noqa: B018 (raises where this C library has none)
except (OSError, AttributeError):
    _libc = None


def map_large_blocks() -> None:
    """From now on, map every block of 1 MiB or more on its own, so that freeing it hands it back.
    glibc would raise its threshold to the largest block freed (up to 32 MiB) and serve such blocks
    from the heap; and once the heap has free room, it serves blocks of any size from there before
    mapping new ones. Set before loading, the load's temporaries (about the model's size, when
    quantized weights are packed) leave no such room; a long step's temporaries are then mapped and
    given back as they are freed, so a step adds only what it holds at once (the 250M Q4_K_M model
    under 64 requests: 1008-1016 MiB at most against 1037-1051 with the threshold set after
    loading). Mapping costs a page fault per 4 KiB touched and an unmap per block: the C++ decoder
    stack keeps its intermediates in buffers of its own for that reason."""
    if _libc is not None:
        _libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)


def trim() -> None:
    """Hand the heap's free pages back to the OS (about 1 ms): after loading, and after a long step,
    whose smaller temporaries stay resident in the heap once freed."""
    if _libc is not None:
        _libc.malloc_trim(0)
