"""What the live dashboard shows of an engine core: its block pool block by block, its queues
request by request, and its last steps. Plain data (no torch), taken between steps and only when
asked for, so that it can cross a process boundary and costs the step loop nothing otherwise.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedllm.core.kv_cache_manager import FREED
from pagedllm.core.messages import SchedulerStats
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler

# A block's state, one character each in EngineSnapshot.blocks.
FREE, CACHED, HELD, SHARED = "f", "c", "h", "s"
STEP_LOG_LENGTH = 256  # steps an engine core remembers for the dashboard


@dataclass
class StepRecord:
    """One engine step, as the dashboard plots it."""

    index: int  # the core's step count
    end: float  # wall clock (time.time()) when it ended
    seconds: float  # schedule, forward pass, sampling and update
    prefill_tokens: int  # prompt tokens computed (and recomputed after a preemption)
    decode_tokens: int  # one a request that samples from its last token, with its drafts
    batch_size: int  # requests in the step
    preemptions: int  # requests preempted while it was scheduled


@dataclass
class RequestView:
    request_id: str
    status: str  # "running", "waiting", "preempted" (waiting to be recomputed) or "held"
    prompt_tokens: int
    computed_tokens: int  # tokens whose K/V are in the cache
    output_tokens: int
    max_tokens: int
    preemptions: int
    blocks: list[int]  # its block table (the first group's, for models with several)
    lora: str | None = None  # the LoRA adapter it runs under


@dataclass
class EngineSnapshot:
    blocks: str  # one state character a block (FREE, CACHED, HELD, SHARED), by block id
    block_size: int
    requests: list[RequestView]  # running (in batch order), then waiting (in queue order), then held
    stats: SchedulerStats  # taken in the same instant
    steps: list[StepRecord] = field(default_factory=list)  # the last ones, oldest first
    time: float = 0.0  # wall clock when taken


class StepLog:
    """The last STEP_LOG_LENGTH steps' records."""

    def __init__(self) -> None:
        self.records: deque[StepRecord] = deque(maxlen=STEP_LOG_LENGTH)
        self.count = 0

    def add(self, end: float, seconds: float, prefill: int, decode: int, batch: int, preemptions: int) -> None:
        self.records.append(StepRecord(self.count, end, seconds, prefill, decode, batch, preemptions))
        self.count += 1


def block_states(scheduler: Scheduler) -> str:
    """Each block's state: free (never filled, or its content evicted), cached (free, but its
    content findable by its hash), held by one request's table, or shared by several."""
    states = []
    for block in scheduler.kv.pool.blocks:
        if block.ref_cnt == 0:
            states.append(FREE if block.block_hash is None else CACHED)
        else:
            states.append(HELD if block.ref_cnt == 1 else SHARED)
    return "".join(states)


def take_snapshot(scheduler: Scheduler, stats: SchedulerStats, log: StepLog, now: float) -> EngineSnapshot:
    tables = scheduler.kv.req_blocks
    views = [_view(r, "running", tables) for r in scheduler.running]
    views += [
        _view(r, "preempted" if r.status == RequestStatus.PREEMPTED else "waiting", tables) for r in scheduler.waiting
    ]
    views += [_view(r, "held", tables) for r in scheduler.held.values()]
    return EngineSnapshot(block_states(scheduler), scheduler.kv.block_size, views, stats, list(log.records), now)


def _view(request: Request, status: str, tables: dict) -> RequestView:
    blocks = [block.block_id for block in tables.get(request.request_id, ()) if block is not FREED]
    return RequestView(
        request.request_id,
        status,
        request.num_prompt_tokens,
        request.num_computed_tokens,
        request.num_output_tokens,
        request.max_tokens,
        request.num_preemptions,
        blocks,
        request.lora_request.lora_name if request.lora_request is not None else None,
    )
