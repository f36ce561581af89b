"""Tensor parallelism's process group: which rank this process is, of how many, and the collectives
the layers call (an all-reduce after each row-parallel layer and after the vocab-parallel
embedding, an all-gather of the vocab-parallel head's logits).

A process that joins no group is rank 0 of 1, and every collective hands its input back: the
single-process engine runs the same layers unchanged. A tensor-parallel worker calls
init_tensor_parallel once, before it builds its model: the layers read the rank and size as they
are built, so that each holds its rank's shard. The collectives run over torch.distributed: gloo
on the CPU; ranks of one machine on the CPU go through a shared-memory region
instead (kernels/shm_collectives.cpp: gloo's all-reduce of a decode's hidden state took 1.8 ms
over this machine's loopback, a shared-memory one a few microseconds), where the region and the
C++ kernels are there.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import time
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory

import torch
import torch.distributed as dist

SHM_SLOT_BYTES = 4 << 20  # a rank's share of one collective; larger tensors go in pieces


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


@dataclass
class SharedRegion:
    """The ranks' shared-memory region (kernels/shm_collectives.cpp) as one rank holds it."""

    memory: shared_memory.SharedMemory
    rank: int
    size: int
    ops: object
    generation: int = 0  # of this rank's last collective: every rank calls them in the same order
    address: int = field(init=False)

    def __post_init__(self) -> None:
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.memory.buf))

    @staticmethod
    def bytes_for(size: int) -> int:
        return 64 * size + 2 * size * SHM_SLOT_BYTES

    @staticmethod
    def create(size: int) -> shared_memory.SharedMemory:
        """A zeroed region for `size` ranks, its pages reserved now: a /dev/shm too small for it
        (a container's 64 MiB) fails here, not with a SIGBUS mid-step."""
        memory = shared_memory.SharedMemory(create=True, size=SharedRegion.bytes_for(size))
        try:
            os.posix_fallocate(memory._fd, 0, memory.size)  # noqa: SLF001
        except OSError as exc:
            memory.close()
            memory.unlink()
            raise RuntimeError(
                f"tensor parallelism needs {SharedRegion.bytes_for(size) >> 20} MiB of shared memory (/dev/shm): {exc}"
            ) from exc
        return memory

    def all_reduce(self, x: torch.Tensor) -> None:
        flat = x.view(-1)
        step = SHM_SLOT_BYTES // x.element_size()
        for start in range(0, flat.numel(), step):
            self.generation += 1
            self.ops.shm_all_reduce(
                flat[start : start + step], self.address, self.rank, self.size, SHM_SLOT_BYTES, self.generation
            )

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x (at least 1-D), in pieces of whole rows along dim 0."""
        rows = max(1, SHM_SLOT_BYTES // max(1, x[:1].numel() * x.element_size()))
        pieces = []
        for start in range(0, x.shape[0], rows):
            piece = x[start : start + rows].contiguous()
            out = piece.new_empty((self.size, *piece.shape))
            self.generation += 1
            self.ops.shm_all_gather(out, piece, self.address, self.rank, self.size, SHM_SLOT_BYTES, self.generation)
            pieces.append(out)
        return torch.cat(pieces, dim=1) if pieces else x.new_empty((self.size, *x.shape))


_shared: SharedRegion | None = None
# Seconds this rank has spent in collectives (waiting for the other ranks included), how many it
# made, and the bytes it put in (its input): benchmarks/tensor_parallel.py reads them through the executor.
collective_time = [0.0, 0, 0]


def tensor_parallel() -> TensorParallel:
    return _group


def init_tensor_parallel(
    rank: int,
    size: int,
    init_method: str,
    device_type: str = "cpu",
    timeout_s: float = 600.0,
    shared_region: str | None = None,
) -> None:
    """Join the group of `size` ranks at `init_method` (a tcp:// or file:// address) as `rank`;
    on the CPU, with `shared_region` (the name of a SharedMemory of SharedRegion.bytes_for(size),
    zeroed), the collectives go through it."""
    global _group, _shared
    if size > 1:
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s)
        )
    _group = TensorParallel(rank, size)
    from pagedllm.kernels import cpu_ops

    ops = cpu_ops()
    if size > 1 and device_type == "cpu" and shared_region is not None and ops is not None:
        memory = shared_memory.SharedMemory(shared_region)
        # The engine made it and removes it; this process only maps it (else its exit would unlink it).
        resource_tracker.unregister(memory._name, "shared_memory")  # noqa: SLF001
        _shared = SharedRegion(memory, rank, size, ops)


def destroy_tensor_parallel() -> None:
    global _group, _shared
    if dist.is_initialized():
        dist.destroy_process_group()
    _group, _shared = TensorParallel(), None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's x, in place (x itself where there is one rank); contiguous x."""
    if _group.size > 1:
        start = time.perf_counter()
        if _shared is not None and x.dtype in (torch.float32, torch.bfloat16):
            _shared.all_reduce(x)
        else:
            dist.all_reduce(x)
        _count(start, x.numel() * x.element_size())
    return x


def _count(start: float, nbytes: int) -> None:
    collective_time[0] += time.perf_counter() - start
    collective_time[1] += 1
    collective_time[2] += nbytes


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x side by side along the last dimension, in rank order."""
    if _group.size == 1:
        return x
    start = time.perf_counter()
    if _shared is not None and x.dim() and x[:1].numel() * x.element_size() <= SHM_SLOT_BYTES:
        parts = _shared.all_gather_rows(x.contiguous()).unbind(0)
    else:
        parts = [torch.empty_like(x) for _ in range(_group.size)]
        dist.all_gather(parts, x.contiguous())
    _count(start, x.numel() * x.element_size())
    return torch.cat(parts, dim=-1)


def all_gather_shares(x: torch.Tensor, total: int) -> torch.Tensor:
    """Every rank's share of `total` columns (split as TensorParallel.split splits them), side by
    side: shares one narrower than the widest are padded for the gather, the padding dropped after."""
    size = _group.size
    if size == 1:
        return x
    width = -(-total // size)
    gathered = all_gather_last(torch.nn.functional.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x)
    if total % size == 0:
        return gathered
    shares = [TensorParallel(rank, size).split(total)[1] for rank in range(size)]
    return torch.cat([gathered[..., rank * width : rank * width + n] for rank, n in enumerate(shares)], dim=-1)


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
        raise ValueError(
            f"--tensor-parallel-size {size}: the model's {num_kv_heads} K/V heads (of {num_heads} "
            f"query heads) neither split over the ranks nor replicate evenly"
        )


def max_kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """The most K/V heads a rank holds (its KV cache's width; the block count is every rank's)."""
    return -(-num_kv_heads // size)
