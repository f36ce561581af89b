"""The engine core's messages: plain, serializable data in and out (no torch, no tokenizer), so that
the core can sit behind a queue, in a thread or another process.

    EngineCoreRequest  -> EngineCore.add_request
    EngineCore.step()  -> list[EngineCoreOutput]: per request touched by the step, what is new
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pagedllm.core.step import TokenLogprobs
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None, never past the model's context
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    # Keep the blocks once finished, until released (finish_requests), for requests forked from it.
    hold: bool = False
    # A held request whose computed tokens begin this prompt: start from its blocks.
    fork_of: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # An embedding request: its prompt is computed (never from the prefix cache) and pooled, and it
    # ends there (max_tokens 0), keeping no KV.
    pooling_params: PoolingParams | None = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, where asked for
    # (index of the first prompt token covered, one entry per prompt token), where asked for
    new_prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    queue_time: float | None = None  # seconds from arrival to first scheduled, once known
    error: str | None = None  # with finish_reason "error": why
    pooled: np.ndarray | None = None  # an embedding request's vector (float32), with its finish
