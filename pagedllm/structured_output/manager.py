"""StructuredOutputManager: the engine core's grammars. A constrained request waits here while its
grammar compiles in a thread of its own (so one slow schema does not stall the other requests'
steps), then joins the scheduler with a matcher; each step the manager fills the token mask of the
constrained requests that sample, and advances their matchers over the tokens they were given.

Compiled grammars are cached by their text (the same schema sent again compiles once)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from pagedllm.core.step import ScheduledRequest, TokenBitmask
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import (
    GrammarKey,
    GrammarMatcher,
    InvalidConstraintError,
    StructuredOutputBackend,
)

logger = logging.getLogger(__name__)
CACHE_SIZE = 256  # compiled grammars kept


@dataclass
class StructuredOutputStats:
    grammars_compiled: int = 0
    compile_seconds: float = 0.0  # in the compiling thread, summed
    cache_hits: int = 0
    masks_filled: int = 0  # rows
    mask_seconds: float = 0.0  # on the engine loop, summed


class StructuredOutputManager:
    def __init__(self, backend: StructuredOutputBackend) -> None:
        self.backend = backend
        self.stats = StructuredOutputStats()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-grammar")
        self._compiled: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._pending: dict[str, tuple[Future, Any]] = {}  # request id -> (its grammar, what to hand back)
        self._matchers: dict[str, GrammarMatcher] = {}

    # -- requests waiting for their grammar ------------------------------------------------------
    def submit(self, request_id: str, params: StructuredOutputsParams, payload: Any) -> None:
        """Start compiling (or find) the request's grammar; `take_ready` hands `payload` back once
        the matcher is made."""
        self._pending[request_id] = (self._compile(params.key), payload)

    def _compile(self, key: GrammarKey) -> Future:
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            self.stats.cache_hits += 1
            return future
        future = self._pool.submit(self._timed_compile, key)
        self._compiled[key] = future
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return future

    def _timed_compile(self, key: GrammarKey) -> object:
        start = time.perf_counter()
        compiled = self.backend.compile(key)
        self.stats.compile_seconds += time.perf_counter() - start
        self.stats.grammars_compiled += 1
        return compiled

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take_ready(self) -> tuple[list[Any], dict[str, tuple[Any, str]]]:
        """Payloads of the requests whose grammar is ready (their matcher made), and of those whose
        grammar failed to compile, by request id, with the reason."""
        ready, failed = [], {}
        for request_id, (future, payload) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            try:
                matcher = self.backend.matcher(future.result())
            except Exception as exc:  # noqa: BLE001 - this request's grammar; the others go on
                failed[request_id] = (
                    payload,
                    f"{InvalidConstraintError.__name__}: the grammar failed to compile: {exc}",
                )
                continue
            if self._is_dead_end(matcher):
                failed[request_id] = (
                    payload,
                    f"{InvalidConstraintError.__name__}: the structured output constraint "
                    "allows no token of this model's vocabulary at its start",
                )
                continue
            self._matchers[request_id] = matcher
            ready.append(payload)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Until a pending grammar is ready or `timeout` seconds pass (the loop has nothing else to do)."""
        if self._pending:
            wait([future for future, _ in self._pending.values()], timeout, return_when=FIRST_COMPLETED)

    # -- requests running --------------------------------------------------------------------
    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    @property
    def num_constrained(self) -> int:
        return len(self._matchers)

    def bitmask(self, scheduled: list[ScheduledRequest]) -> TokenBitmask | None:
        """The step's mask: rows for each constrained request that samples, one a position: after
        its tokens so far, then after each of its drafts (the matcher walks them, then rolls back:
        the drafts were cut to what the grammar takes, `valid_drafts`)."""
        if not self._matchers:  # the usual step: nothing to look through
            return None
        constrained = [s for s in scheduled if s.sample and s.request_id in self._matchers]
        if not constrained:
            return None
        start = time.perf_counter()
        words = self.backend.allocate_bitmask(sum(1 + s.num_spec_tokens for s in constrained))
        rows: dict[str, int] = {}
        row = 0
        for s in constrained:
            matcher, rows[s.request_id] = self._matchers[s.request_id], row
            matcher.fill_bitmask(words, row)
            for token in s.spec_token_ids:
                if not matcher.accept_token(token):
                    raise RuntimeError(f"{s.request_id}: a draft the grammar refuses was scheduled")
                row += 1
                matcher.fill_bitmask(words, row)
            if s.num_spec_tokens:
                matcher.rollback(s.num_spec_tokens)
            row += 1
        self.stats.masks_filled += len(words)
        self.stats.mask_seconds += time.perf_counter() - start
        return TokenBitmask(rows, words)

    def valid_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """The drafts before the first that the request's grammar refuses or that ends it (a
        finished matcher has no mask for the position after; the end is sampled as usual). The
        matcher is left as it was."""
        matcher = self._matchers[request_id]
        walked = taken = 0
        for token in drafts:
            if not matcher.accept_token(token):
                break
            walked += 1
            if matcher.is_terminated():
                break
            taken += 1
        if walked:
            matcher.rollback(walked)
        return drafts[:taken]

    def is_dead_end(self, request_id: str) -> bool:
        """Whether the request's grammar, where it stands, allows no token of the vocabulary (it
        needs a character no token spells) and is not complete."""
        return self._is_dead_end(self._matchers[request_id])

    def _is_dead_end(self, matcher: GrammarMatcher) -> bool:
        words = self.backend.allocate_bitmask(1)
        matcher.fill_bitmask(words, 0)
        return not words.any() and not matcher.is_terminated()

    def accept(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance a request's matcher over its new tokens; False if the grammar refused one."""
        matcher = self._matchers.get(request_id)
        return matcher is None or all(matcher.accept_token(t) for t in token_ids)

    def is_terminated(self, request_id: str) -> bool:
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_terminated()

    def remove(self, request_id: str) -> Any:
        """Forget a request (finished, aborted); returns its payload if it was still waiting."""
        self._matchers.pop(request_id, None)
        pending = self._pending.pop(request_id, None)
        return pending[1] if pending else None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
