"""Pooling a prompt's hidden states into one embedding: the mean of its tokens, its first token
([CLS]) or its last one, then optionally cut to fewer dimensions (Matryoshka) and scaled to unit
length. A prompt may be computed in chunks over several steps: each chunk's rows are folded into a
small running state, so no step keeps another's hidden states."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.config import PoolerConfig
from pagedllm.pooling_params import PoolingParams


@dataclass
class PoolingState:
    """What one request's chunks so far leave for its embedding: an fp32 sum and count (MEAN), the
    first row (CLS) or the latest row (LAST); `seen`: the prompt positions folded in."""

    total: torch.Tensor | None = None
    count: int = 0
    seen: int = 0


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

    def accumulate(self, state: PoolingState, rows: torch.Tensor, first_position: int) -> None:
        """Fold a chunk's hidden states (prompt positions first_position...) into the state. Positions
        already folded are skipped: a failed step is rerun with the same chunk."""
        skip = max(state.seen - first_position, 0)
        rows, first_position = rows[skip:], first_position + skip
        if rows.shape[0] == 0:
            return
        state.seen = first_position + rows.shape[0]
        kind = self.config.pooling_type
        if kind == "MEAN":
            chunk = rows.float().sum(dim=0)
            state.total = chunk if state.total is None else state.total + chunk
            state.count += rows.shape[0]
        elif kind == "CLS":
            if first_position == 0:
                state.total, state.count = rows[0].float(), 1
        else:
            state.total, state.count = rows[-1].float(), 1

    def finish(
        self,
        state: PoolingState,
        params: PoolingParams,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> np.ndarray:
        """The embedding: pooled, cut to `dimensions`, normalized unless the request or model says
        not. For "classify" and "score", the model's head over the pooled state instead: the labels'
        probabilities (softmax), or the pair's score (the model's `activation`, as a one-label
        classification is)."""
        if state.total is None:
            raise RuntimeError("pooling a prompt none of whose hidden states were seen")
        vector = state.total / state.count
        if params.task != "embed":
            if head is None:
                raise RuntimeError(f"this model has no head for {params.task!r}")
            logits = head(vector)
            # Labels' probabilities; one label (a reranker's) goes through the model's activation.
            several = params.task == "classify" and logits.shape[-1] > 1
            out = torch.softmax(logits, dim=-1) if several or activation is None else activation(logits)
            return out.cpu().numpy().astype(np.float32, copy=False)
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.cpu().numpy().astype(np.float32, copy=False)
