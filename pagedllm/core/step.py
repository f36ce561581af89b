"""The two messages of one engine step: what the scheduler asks for, what the model runner answers."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    request_id: str
    new_token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # position of new_token_ids[0] (= tokens already in the KV cache)
    block_ids: list[int]  # the request's whole block table
    sampling_params: SamplingParams
    all_token_ids: list[int]  # prompt + output so far, for penalties
    num_prompt_tokens: int
    num_output_tokens: int
    sample: bool  # this chunk reaches the last known token: sample the next one
    eos_token_ids: frozenset[int] = frozenset()
    # The last `num_spec_tokens` of new_token_ids are draft tokens to verify (speculative decoding):
    # the runner answers with the drafts it accepts, in order, then one token of its own.
    num_spec_tokens: int = 0


@dataclass
class TokenBitmask:
    """Which tokens each of some requests may sample this step: one row of packed 32-bit words per
    request, bit t % 32 of word t // 32 set where token t is allowed (the layout grammar backends
    such as xgrammar fill). Requests without a row are not constrained."""
    rows: dict[str, int]  # request id -> row
    words: list[list[int]]  # [row][ceil(vocab / 32)], each word in [0, 2**32)

    @staticmethod
    def pack(allowed: list[int], vocab_size: int) -> list[int]:
        """One row allowing exactly `allowed` (for tests, and backends without their own packing)."""
        words = [0] * -(-vocab_size // 32)
        for token in allowed:
            words[token // 32] |= 1 << (token % 32)
        return words


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # Requests that ended since the last step: the runner drops any state it keeps for them.
    finished_request_ids: set[str] = field(default_factory=set)
    # (src, dst) KV blocks to copy before the forward pass (copy-on-write of shared blocks).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Token masks for the requests sampled this step that are constrained (structured output).
    token_bitmask: TokenBitmask | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(r.new_token_ids) for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token first, then the top-k."""
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    # request id -> the step's new tokens (one, or accepted drafts and one more), and their logprobs
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> (index of the first prompt token covered, one entry per prompt token)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)

    def merge(self, other: ModelRunnerOutput) -> None:
        """Take in another run's results for other requests (a step rerun request by request)."""
        self.sampled_token_ids.update(other.sampled_token_ids)
        self.logprobs.update(other.logprobs)
        self.prompt_logprobs.update(other.prompt_logprobs)
