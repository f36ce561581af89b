"""The two messages of one engine step: what the scheduler asks for, what the model runner answers.

The worker keeps its own copy of each request it runs (worker/input_batch.py), so a request's data
(prompt, sampling parameters, block table) travels once and each later step carries only deltas.
Plain data, no torch: the messages can cross a process boundary."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedllm.core.messages import TokenLogprobs
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal import MultiModalFeature
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """What the worker keeps of a request, sent once: when the request is first scheduled, or when it
    resumes after preemption (the worker dropped it then). Later steps bring only what changed."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (before a preemption, or a fork's); the worker appends the rest
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    pooling_params: PoolingParams | None = None  # an embedding request: pooled at its prompt's end, not sampled
    mm_features: tuple[MultiModalFeature, ...] = ()  # its prompt's images, with the encoder's inputs
    lora_request: LoRARequest | None = None  # the adapter it runs under


@dataclass
class ScheduledRequest:
    """One request's part of a step: the deltas to the worker's copy of it (the whole of it, with
    `new_request`, the first time) and what to compute. Applying it twice changes nothing more than
    applying it once: a failed step is rerun request by request with the same message."""

    request_id: str
    # Tokens in the KV cache before this step, as the scheduler counts them (after rolling rejected
    # drafts back); the step computes the next `num_new_tokens` positions: the request's next known
    # tokens, then its `spec_token_ids`.
    num_computed_tokens: int
    num_new_tokens: int
    # The worker keeps the first `num_kept_blocks` entries of its block table and appends
    # `new_block_ids` (new blocks; a block copied on write; nothing after a cut back to fewer).
    num_kept_blocks: int
    new_block_ids: list[int]
    sample: bool  # this step reaches the last known token: sample the next one
    new_request: NewRequestData | None = None
    # Draft tokens to verify (speculative decoding), which only the scheduler knows: the runner
    # answers with the drafts it accepts, in order, then one token of its own.
    spec_token_ids: list[int] = field(default_factory=list)
    # Models whose layers keep K/V in several groups (config.KVCacheGroups): the block tables of
    # groups 1.. as (num_kept_blocks, new_block_ids) each; the fields above are group 0's.
    other_group_blocks: list[tuple[int, list[int]]] = field(default_factory=list)
    # Indexes into the request's mm_features of the images to encode before this step (their
    # outputs go into the worker's encoder cache, by identifier, until evicted).
    encoder_inputs: list[int] = field(default_factory=list)
    # The KV store (--kv-offload-dir): (block hash, block id) of the full blocks this step completes,
    # which the worker copies out after the step and writes to the store in the background.
    kv_saves: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_spec_tokens(self) -> int:
        return len(self.spec_token_ids)


@dataclass
class TokenBitmask:
    """Which tokens each of some requests may sample this step: rows of packed 32-bit words, bit
    t % 32 of word t // 32 set where token t is allowed (the layout grammar backends such as
    xgrammar fill). A request with k drafts has k + 1 rows, one a position (its row + j: after
    drafts[:j]). Requests without a row are not constrained."""

    rows: dict[str, int]  # request id -> its (first) row
    words: np.ndarray  # int32 [rows, ceil(vocab / 32)]

    @staticmethod
    def pack(allowed: list[int], vocab_size: int) -> np.ndarray:
        """One row allowing exactly `allowed` (for tests, and backends without their own packing)."""
        bits = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
        bits[allowed] = True
        return np.packbits(bits, bitorder="little").view("<i4")


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # Requests that ended since the last step: the worker drops what it holds of them.
    finished_request_ids: set[str] = field(default_factory=set)
    # Requests preempted this step: the worker drops them too; they come back whole when they resume.
    preempted_request_ids: set[str] = field(default_factory=set)
    # (src, dst) KV blocks to copy before the forward pass (copy-on-write of shared blocks).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Token masks for the requests sampled this step that are constrained (structured output).
    token_bitmask: TokenBitmask | None = None
    # Draft-model speculation: request id -> how many drafts the worker's draft model proposes for
    # it after this step's sampling (the engine core's choice; absent or 0: none).
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # Images' identifiers the encoder cache evicted: the worker drops their outputs first.
    evicted_encoder_ids: list[int] = field(default_factory=list)
    # The KV store: (block hash, block id) of blocks to read into the cache before the forward pass
    # (the ids are the scheduler's, held for no scheduled request); the answer says which were whole.
    kv_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.kv_loads


@dataclass
class KVStoreReport:
    """What the worker's KV store did in a step: the loads read whole and those that were not; the
    blocks it no longer holds (evicted for room, writes that failed or were dropped); its reads and
    writes since the last report (the writes run in the background)."""

    loaded: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    read_blocks: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    write_blocks: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0

    def merge(self, other: KVStoreReport) -> None:
        self.loaded += other.loaded
        self.failed += other.failed
        self.dropped += other.dropped
        self.read_blocks += other.read_blocks
        self.read_bytes += other.read_bytes
        self.read_seconds += other.read_seconds
        self.write_blocks += other.write_blocks
        self.write_bytes += other.write_bytes
        self.write_seconds += other.write_seconds


@dataclass
class ModelRunnerOutput:
    # request id -> the step's new tokens (one, or accepted drafts and one more), and their logprobs
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> (index of the first prompt token covered, one entry per prompt token)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # request id -> its embedding (float32), for embedding requests whose prompt the step finished
    pooler_output: dict[str, np.ndarray] = field(default_factory=dict)
    # request id -> draft tokens a draft model proposed for the next step (SchedulerOutput.num_draft_tokens)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_seconds: float = 0.0  # time the draft model's passes took (taken out of the step's time)
    # (seconds, tokens) of its passes that fed one token a request: what a draft token costs
    draft_token_cost: tuple[float, int] = (0.0, 0)
    kv_store: KVStoreReport | None = None  # with --kv-offload-dir

    def merge(self, other: ModelRunnerOutput) -> None:
        """Take in another run's results for other requests (a step rerun request by request)."""
        self.sampled_token_ids.update(other.sampled_token_ids)
        self.logprobs.update(other.logprobs)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.pooler_output.update(other.pooler_output)
        self.spec_token_ids.update(other.spec_token_ids)
        self.draft_seconds += other.draft_seconds
        (seconds, tokens), (more_seconds, more_tokens) = self.draft_token_cost, other.draft_token_cost
        self.draft_token_cost = (seconds + more_seconds, tokens + more_tokens)
        if other.kv_store is not None:
            if self.kv_store is None:
                self.kv_store = KVStoreReport()
            self.kv_store.merge(other.kv_store)
