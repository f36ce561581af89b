"""The engine core's messages: plain, serializable data in and out (no torch, no tokenizer), so that
the core can sit behind a queue, in a thread or another process.

    EngineCoreRequest  -> EngineCore.add_request
    EngineCore.step()  -> list[EngineCoreOutput]: per request touched by the step, what is new
    SchedulerStats     -> what the scheduler and KV cache report after a step (metrics, dashboard)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal import MultiModalFeature
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
    mm_features: tuple[MultiModalFeature, ...] = ()  # its prompt's images (placeholders expanded)
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    priority: int = 0  # under the priority policy: lower runs first


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


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_cache_usage: float  # share of blocks in use
    kv_waste: float  # share of allocated slots that hold no token
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found cached
    spec_num_drafts: int = 0  # steps that verified draft tokens (speculative decoding), a request each
    spec_num_draft_tokens: int = 0  # draft tokens verified
    spec_num_accepted_tokens: int = 0  # draft tokens accepted
    spec_accepted_per_position: tuple[int, ...] = ()  # [j]: drafts whose token j + 1 was accepted
    # Images (core/encoder_cache_manager.py): the cache's size and use in embedding rows, its
    # entries, and the images looked up (hits: found encoded; the rest were encoded).
    encoder_cache_size: int = 0
    encoder_cache_used: int = 0
    encoder_cache_entries: int = 0
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    # LoRA adapters (by name) of the running and the waiting requests, and the most one step runs.
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0
    # The KV cache's second tier (--kv-offload-dir; core/kv_tier.py): blocks it holds, and since the
    # start, blocks read back instead of computed, reads that failed, bytes and seconds of reads
    # and of (background) writes.
    kv_tier_blocks: int = 0
    kv_tier_bytes: int = 0
    kv_tier_hits: int = 0
    kv_tier_failures: int = 0
    kv_tier_read_bytes: int = 0
    kv_tier_read_seconds: float = 0.0
    kv_tier_write_blocks: int = 0
    kv_tier_write_bytes: int = 0
    kv_tier_write_seconds: float = 0.0

    @staticmethod
    def merge(replicas: list[SchedulerStats]) -> SchedulerStats:
        """The stats of several engine replicas (data parallelism) as one engine's: counts summed,
        shares weighted by the blocks they are shares of."""
        if len(replicas) == 1:
            return replicas[0]
        total = sum(s.kv_blocks_total for s in replicas)
        used = [s.kv_blocks_total - s.kv_blocks_free for s in replicas]
        width = max(len(s.spec_accepted_per_position) for s in replicas)
        summed = {
            name: sum(getattr(s, name) for s in replicas)
            for name in (
                "num_running",
                "num_waiting",
                "kv_blocks_total",
                "kv_blocks_free",
                "num_preemptions",
                "prefix_cache_queries",
                "prefix_cache_hits",
                "spec_num_drafts",
                "spec_num_draft_tokens",
                "spec_num_accepted_tokens",
                "encoder_cache_size",
                "encoder_cache_used",
                "encoder_cache_entries",
                "encoder_cache_queries",
                "encoder_cache_hits",
                "kv_tier_blocks",
                "kv_tier_bytes",
                "kv_tier_hits",
                "kv_tier_failures",
                "kv_tier_read_bytes",
                "kv_tier_read_seconds",
                "kv_tier_write_blocks",
                "kv_tier_write_bytes",
                "kv_tier_write_seconds",
            )
        }
        return SchedulerStats(
            **summed,
            kv_cache_usage=sum(used) / total if total else 0.0,
            kv_waste=sum(s.kv_waste * u for s, u in zip(replicas, used)) / sum(used) if sum(used) else 0.0,
            spec_accepted_per_position=tuple(
                sum(s.spec_accepted_per_position[j] for s in replicas if j < len(s.spec_accepted_per_position))
                for j in range(width)
            ),
            running_loras=tuple(sorted({name for s in replicas for name in s.running_loras})),
            waiting_loras=tuple(sorted({name for s in replicas for name in s.waiting_loras})),
            max_loras=replicas[0].max_loras,
        )
