"""CUDA graphs for decode steps: the model's forward pass captured once for each of a few batch
sizes, over static buffers, and replayed for a step of one token a request, padded up to the
nearest captured size (--enforce-eager: none).

A replay launches every kernel of the pass at once, with no Python between them. The step's ids,
positions, slots, block tables and lengths are copied into the buffers' first rows; the rows past
the step's requests attend one key of a scratch block no request owns (the cache's last block,
allocated for this) and write their K/V there. Every query token is computed the same whatever
its row and whatever else its step holds, so padding changes no request's output.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedllm.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes captured (vLLM's default series): 1, 2, 4, then every multiple of 8,
    up to max_num_seqs (rounded up to a size that holds it) and at most 512."""
    sizes = [1, 2, 4, *range(8, 513, 8)]
    last = next((s for s in sizes if s >= max_num_seqs), sizes[-1])
    return tuple(s for s in sizes if s <= last)


class Graph(Protocol):
    """What a captured pass offers: torch.cuda.CUDAGraph's replay (tests stand in an eager one)."""

    def replay(self) -> None: ...


def capture_cuda_graph(run: Callable[[], torch.Tensor], pool: Any) -> tuple[Graph, torch.Tensor, Any]:
    """run() captured into a CUDA graph on a side stream (after one warm-up run, which compiles
    Triton's kernels), sharing `pool` with the other sizes'; its output tensor, and the pool."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out, graph.pool()


@dataclass
class _Buffers:
    """The captured passes' inputs, for the largest size (a smaller size's are their first rows)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    token_seq: torch.Tensor

    @classmethod
    def of(cls, size: int, width: int, scratch_block: int, block_size: int, device: torch.device) -> _Buffers:
        scratch_slot = scratch_block * block_size
        return cls(
            input_ids=torch.zeros(size, dtype=torch.long, device=device),
            positions=torch.zeros(size, dtype=torch.long, device=device),
            slot_mapping=torch.full((size,), scratch_slot, dtype=torch.long, device=device),
            block_tables=torch.full((size, width), scratch_block, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(size, dtype=torch.int32, device=device),
            token_seq=torch.arange(size, device=device),
        )

    def metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            seq_lens_list=[1] * size,  # (read by no kernel a graph holds)
            query_lens_list=[1] * size,
            token_seq=self.token_seq[:size],
        )


class CudaGraphRunner:
    """The model's decode passes at `sizes`, over `kv_caches` whose block `scratch_block` no
    request owns; `table_width`: the most blocks a request's table holds."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list,
        sizes: tuple[int, ...],
        table_width: int,
        scratch_block: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.sizes = tuple(sorted(sizes))
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        self.buffers = _Buffers.of(self.sizes[-1], table_width, scratch_block, block_size, device)
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        self.replays = 0  # steps replayed (the stats and the tests read it)
        pool = None
        for size in reversed(self.sizes):  # the largest first: the smaller ones fit in its pool
            run = self._pass(model, kv_caches, size)
            graph, out, pool = capture_cuda_graph(run, pool)  # (looked up here: tests stand in an eager one)
            self.graphs[size] = (graph, out)

    def _pass(self, model: torch.nn.Module, kv_caches: list, size: int) -> Callable[[], torch.Tensor]:
        b, meta = self.buffers, self.buffers.metadata(size)
        return lambda: model(b.input_ids[:size], b.positions[:size], kv_caches, meta)

    def size_for(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The decode step's hidden states [requests, hidden] by a replay; None where the step is
        not one a graph holds (a request with more than one token, more requests than the largest
        size, a wider block table than max_model_len's, a model's step with more than the usual
        metadata). The rows are the graph's output
        buffer's: read them before the next replay."""
        n = input_ids.shape[0]
        size = self.size_for(n)
        if (
            size is None
            or len(meta.query_lens_list) != n
            or meta.block_tables.shape[1] > self.buffers.block_tables.shape[1]
            or meta.group_tables
            or meta.image_spans
            or meta.token_types is not None
            or positions.dim() != 1
        ):
            return None
        b = self.buffers
        b.input_ids[:n].copy_(input_ids)
        b.positions[:n].copy_(positions)
        b.slot_mapping[:n].copy_(meta.slot_mapping)
        b.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        b.block_tables[:n, :width].copy_(meta.block_tables)
        # The padding rows: one key, in the scratch block (a row a bigger step used is reset).
        b.slot_mapping[n:size].fill_(self.scratch_slot)
        b.seq_lens[n:size].fill_(1)
        b.block_tables[n:size, 0].fill_(self.scratch_block)
        graph, out = self.graphs[size]
        graph.replay()
        self.replays += 1
        return out[:n]
