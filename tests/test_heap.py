"""The KV cache's memory: zeros, advised to Linux as huge pages where it takes the advice."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedllm import heap


def _huge_pages_on_request() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return sys.platform.startswith("linux") and path.exists() and "[never]" not in path.read_text()


def _mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping in /proc/self/smaps that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_kv_zeros_are_zeros_of_the_shape(dtype):
    cache = heap.kv_zeros((64, 16, 2, 64), dtype, torch.device("cpu"))
    assert cache.shape == (64, 16, 2, 64) and cache.dtype == dtype
    assert not cache.any()


@pytest.mark.skipif(not _huge_pages_on_request(), reason="no transparent huge pages here")
def test_kv_zeros_advise_huge_pages():
    cache = heap.kv_zeros((256, 16, 4, 64), torch.bfloat16, torch.device("cpu"))  # 8 MiB
    middle = cache.data_ptr() + cache.numel() * cache.element_size() // 2
    assert "hg" in _mapping_flags(middle)  # MADV_HUGEPAGE's mark on the mapping
