"""Tensor parallelism's process group: which rank this process is, of how many, and the collectives
the layers call (an all-reduce after each row-parallel layer and after the vocab-parallel
embedding, an all-gather of the vocab-parallel head's logits).

A process that joins no group is rank 0 of 1, and every collective hands its input back: the
single-process engine runs the same layers unchanged. A tensor-parallel worker calls
init_tensor_parallel once, before it builds its model: the layers read the rank and size as they
are built, so that each holds its rank's shard. The collectives run over torch.distributed: gloo
on the CPU, nccl on CUDA.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def split(self, n: int) -> tuple[int, int]:
        """(start, count) of this rank's share of n things split as evenly as they go (the first
        n % size ranks take one more)."""
        base, extra = divmod(n, self.size)
        return self.rank * base + min(self.rank, extra), base + (self.rank < extra)


_group = TensorParallel()


def tensor_parallel() -> TensorParallel:
    return _group


def init_tensor_parallel(rank: int, size: int, init_method: str, device_type: str = "cpu",
                         timeout_s: float = 600.0) -> None:
    """Join the group of `size` ranks at `init_method` (a tcp:// or file:// address) as `rank`."""
    global _group
    if size > 1:
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _group = TensorParallel(rank, size)


def destroy_tensor_parallel() -> None:
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TensorParallel()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's x, in place (x itself where there is one rank)."""
    if _group.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x side by side along the last dimension, in rank order."""
    if _group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_group.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class HeadShare:
    """A rank's attention heads: its query heads and K/V heads, first and count of each."""
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_share(num_heads: int, num_kv_heads: int, tp: TensorParallel | None = None) -> HeadShare:
    """This rank's heads: whole groups (a K/V head with the query heads that read it) split as
    evenly as they go (9 heads, 3 K/V heads over 2 ranks: 6 and 3 query heads); where there are
    fewer K/V heads than ranks, each is held by size / num_kv_heads ranks, which split its group's
    query heads (check_head_split says where neither works)."""
    tp = tp or _group
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp.size:
        kv_start, kv_count = tp.split(num_kv_heads)
        return HeadShare(kv_start * group, kv_count * group, kv_start, kv_count)
    holders = tp.size // num_kv_heads
    kv, q_count = tp.rank // holders, group // holders
    return HeadShare(kv * group + tp.rank % holders * q_count, q_count, kv, 1)


def check_head_split(num_heads: int, num_kv_heads: int, size: int) -> None:
    """A ValueError where the heads cannot split over `size` ranks."""
    if num_kv_heads < size and (size % num_kv_heads or num_heads // num_kv_heads % (size // num_kv_heads)):
        raise ValueError(f"--tensor-parallel-size {size}: the model's {num_kv_heads} K/V heads (of {num_heads} "
                         f"query heads) neither split over the ranks nor replicate evenly")


def max_kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """The most K/V heads a rank holds (its KV cache's width; the block count is every rank's)."""
    return -(-num_kv_heads // size)
