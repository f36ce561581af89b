"""InputBatch: the worker's own copy of the requests it runs, kept from step to step.

A request's data (prompt, output so far, sampling parameters, block table) arrives once, in a
step's `NewRequestData`; later steps bring deltas: how many tokens are computed (the scheduler's
count, which rolls rejected drafts back), the block table's changed tail, draft tokens. The tokens
the worker samples it appends itself. A step's inputs are built from that copy: each request's
new tokens sliced from its own list, positions and slots from its own table; the block tables of
a large batch are one copy out of an int32 array that keeps every table in a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.core.step import NewRequestData, ScheduledRequest, SchedulerOutput
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.pooler import PoolingState
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal import MultiModalFeature
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

_CPU = torch.device("cpu")


@dataclass(eq=False)
class RequestState:
    """The worker's copy of one request: what the sampler and the step's inputs read."""

    request_id: str
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    num_prompt_tokens: int
    all_token_ids: list[int]  # prompt, then output: the worker appends what it samples
    row: int = 0  # of the batch's block table array
    block_ids: list[int] = field(default_factory=list)  # its block table, also in that row of the array
    num_computed_tokens: int = 0  # before the last step scheduled, as the scheduler counted them
    pooling_params: PoolingParams | None = None  # an embedding request: pooled, not sampled
    pooling: PoolingState = field(default_factory=PoolingState)  # its chunks' hidden states so far
    other_block_ids: list[list[int]] = field(default_factory=list)  # the block tables of groups 1.., if any
    # The sampler's view at a step's draft position j (the state with drafts[:j] appended): its
    # token mask is the request's row + j.
    spec_position: int = 0
    mm_features: tuple[MultiModalFeature, ...] = ()  # its prompt's images
    # Its prompt's M-RoPE positions (the model's RopePositions), made at its first step that needs them.
    rope_positions: Any = None
    lora_request: LoRARequest | None = None  # the adapter it runs under

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens


class InputBatch:
    """The requests the worker holds, by id; `rows` x `width` is the block-table array's first size.
    Steps whose block tables have at most `max_list_table_entries` entries build them from lists."""

    def __init__(
        self,
        block_size: int,
        device: torch.device = _CPU,
        rows: int = 8,
        width: int = 16,
        max_list_table_entries: int = 512,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.max_list_table_entries = max_list_table_entries
        self.requests: dict[str, RequestState] = {}
        self.block_table = np.zeros((rows, width), dtype=np.int32)  # grows (doubles) when full
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: lowest first

    # -- the step's message ------------------------------------------------------------------------
    def update(self, output: SchedulerOutput) -> list[RequestState]:
        """Take in a step's message; returns the scheduled requests' states, in the step's order.
        Idempotent: a step the engine reruns request by request brings the same message again."""
        for request_id in output.finished_request_ids | output.preempted_request_ids:
            self._remove(request_id)
        return [self._apply(s) for s in output.scheduled]

    def _apply(self, s: ScheduledRequest) -> RequestState:
        if s.new_request is not None:
            state = self._add(s.request_id, s.new_request)
        else:
            state = self.requests[s.request_id]
        state.num_computed_tokens = s.num_computed_tokens
        if s.new_block_ids or s.num_kept_blocks != len(state.block_ids):
            self._set_blocks(state, s.num_kept_blocks, s.new_block_ids)
        for g, (num_kept, new_ids) in enumerate(s.other_group_blocks):
            if g == len(state.other_block_ids):
                state.other_block_ids.append([])
            state.other_block_ids[g][num_kept:] = new_ids
        return state

    def _add(self, request_id: str, data: NewRequestData) -> RequestState:
        self._remove(request_id)  # sent again: a rerun of the step
        state = RequestState(
            request_id,
            data.sampling_params,
            data.eos_token_ids,
            len(data.prompt_token_ids),
            data.prompt_token_ids + data.output_token_ids,
            row=self._take_row(),
            pooling_params=data.pooling_params,
            mm_features=data.mm_features,
            lora_request=data.lora_request,
        )
        self.requests[request_id] = state
        return state

    def _remove(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def _take_row(self) -> int:
        if not self._free_rows:
            rows = self.block_table.shape[0]
            self._resize(2 * rows, self.block_table.shape[1])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _set_blocks(self, state: RequestState, num_kept: int, new_block_ids: list[int]) -> None:
        state.block_ids[num_kept:] = new_block_ids
        end = len(state.block_ids)
        if end > self.block_table.shape[1]:
            self._resize(self.block_table.shape[0], max(end, 2 * self.block_table.shape[1]))
        self.block_table[state.row, num_kept:end] = new_block_ids

    def _resize(self, rows: int, width: int) -> None:
        old = self.block_table
        self.block_table = np.zeros((rows, width), dtype=np.int32)
        self.block_table[: old.shape[0], : old.shape[1]] = old

    def append_sampled(self, sampled_token_ids: dict[str, list[int]]) -> None:
        """After a step that ran: each request's new tokens (accepted drafts, then the runner's own),
        as the scheduler appends them. Ids the batch does not hold (samples forked at this step,
        which come as new requests) are skipped."""
        for request_id, tokens in sampled_token_ids.items():
            state = self.requests.get(request_id)
            if state is not None:
                state.all_token_ids += tokens

    # -- the step's tensors ------------------------------------------------------------------------
    def prepare(
        self, scheduled: list[ScheduledRequest], states: list[RequestState]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of a step, from the states `update` returned."""
        runs = []
        for s, state in zip(scheduled, states):
            start = state.num_computed_tokens
            # The known tokens, then the drafts.
            runs.append((state, start, state.all_token_ids[start : start + s.num_new_tokens] + s.spec_token_ids))
        input_ids, positions, meta = self.prepare_runs(runs)
        meta.group_tables = self._other_group_tables(scheduled, states)
        return input_ids, positions, meta

    def prepare_runs(
        self, runs: list[tuple[RequestState, int, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata for runs of tokens, each (state, its first
        position, the tokens) under the state's block table (a draft model's passes use it too)."""
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        for state, start, tokens in runs:
            end = start + len(tokens)
            token_ids += tokens
            positions += range(start, end)
            blocks = state.block_ids
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + len(tokens))
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.long),
            block_tables=self._block_tables([run[0] for run in runs]),
            query_start_loc=self._tensor(query_start_loc, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            seq_lens_list=seq_lens,
            query_lens_list=[len(run[2]) for run in runs],
        )
        return self._tensor(token_ids, torch.long), self._tensor(positions, torch.long), meta

    def _other_group_tables(
        self, scheduled: list[ScheduledRequest], states: list[RequestState]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(slot mapping, block tables) of each group past the first, from lists (the models with
        several groups, Gemma's, run op by op: a few lists a step are not what they wait on)."""
        bs = self.block_size
        tables = []
        for g in range(len(states[0].other_block_ids) if states else 0):
            slots: list[int] = []
            for s, state in zip(scheduled, states):
                blocks = state.other_block_ids[g]
                slots += [
                    blocks[p // bs] * bs + p % bs
                    for p in range(state.num_computed_tokens, state.num_computed_tokens + s.num_new_tokens)
                ]
            width = max(len(state.other_block_ids[g]) for state in states)
            rows = [state.other_block_ids[g] + [0] * (width - len(state.other_block_ids[g])) for state in states]
            tables.append((self._tensor(slots, torch.long), self._tensor(rows, torch.int32)))
        return tables

    def _block_tables(self, states: list[RequestState]) -> torch.Tensor:
        """The step's block tables, zero-padded to the longest. A few entries come from lists: numpy's
        first call after a forward pass (which evicted its code from the caches) costs some 40 us,
        against 5 us here at batch 1. More come as one copy out of the table array: lists took 2 ms
        at 256 requests of 130 blocks, the copy 15 us."""
        width = max(len(state.block_ids) for state in states)
        if len(states) * width <= self.max_list_table_entries:
            return self._tensor(
                [state.block_ids + [0] * (width - len(state.block_ids)) for state in states], torch.int32
            )
        rows = [state.row for state in states]
        return torch.as_tensor(self.block_table[:, :width].take(rows, axis=0), device=self.device)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)
