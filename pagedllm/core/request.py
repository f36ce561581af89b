"""Request: one sequence's state as the scheduler sees it (token ids, progress, status)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal import MultiModalFeature
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def cache_root(cache_salt: str | None, lora_request: LoRARequest | None) -> tuple:
    """What a request's first block hash starts from: blocks are shared only between requests of
    the same salt and the same adapter (K/V computed under an adapter are not the base model's)."""
    return (cache_salt, lora_request.cache_key if lora_request is not None else None)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None, never past the model's context
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    # Tie-breaker that orders requests by arrival even when clocks are equal.
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    cache_salt: str | None = None  # keeps prefix-cache sharing within those who know the salt
    # Once finished, keep the blocks (held) until the frontend releases the request: it forks
    # other requests from them (the prompt of parallel samples, beams between steps).
    hold: bool = False
    # Speculative decoding: draft tokens for the next step, verified by the runner. A proposer sets
    # (replaces) them before each schedule(); the scheduler clears them once scheduled.
    spec_token_ids: list[int] = field(default_factory=list)
    num_reported_tokens: int = 0  # output tokens already sent out in an EngineCoreOutput
    pooling_params: PoolingParams | None = None  # an embedding request (prompt only, pooled)
    mm_features: tuple[MultiModalFeature, ...] = ()  # its prompt's images, by offset
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    priority: int = 0  # under the priority policy: lower runs first, then by arrival

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.block_hashes: list[int] = []  # of its full blocks, filled by the KV cache manager

    @property
    def cache_root(self) -> tuple:
        return cache_root(self.cache_salt, self.lora_request)

    @property
    def lora_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """After a token is appended: set a finished status if the request is done."""
        params = self.sampling_params
        if self.output_token_ids and self.num_output_tokens >= params.min_tokens:
            last = self.output_token_ids[-1]
            if last in self.eos_token_ids and not params.ignore_eos:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in (params.stop_token_ids or ()):
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
