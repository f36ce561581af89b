"""Beam search as the engine runs it: one request of the frontend, driven between the core's steps.

Each beam is a one-token engine-core request that is held when it finishes: it keeps its blocks,
and its output brings the top-2k logprobs of the next position. Once every live beam of a request
has its output, the driver takes the k best continuations and starts each as a new core request
forked from its parent beam (it shares all the parent's blocks; the partial last one is copied on
the first write), and releases the parents, which frees what only they held. The prompt is
computed once. LLMEngine holds a driver per beam-search request and feeds it its beams' outputs;
the request's one RequestOutput (the beam_width best beams, best first) comes when it is done, so
the offline LLM and the server run beam search through the same engine loop as any request.

Selection follows Hugging Face's beam search: candidates ranked by cumulative logprob; an EOS
candidate ranked within the top k ends a hypothesis; hypotheses are scored at the end by
cum_logprob / generated_length ** length_penalty.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.core.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class _Beam:
    request_id: str  # its core request's
    tokens: list[int]  # generated so far
    cum_logprob: float
    next_logprobs: TokenLogprobs | None = None  # of the position after `tokens`, once computed


@dataclass
class Hypothesis:
    """A finished beam."""

    tokens: list[int]  # generated
    cum_logprob: float
    finish_reason: str  # "stop" (EOS) or "length"


def beam_score(hypothesis: Hypothesis, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    """cum_logprob / generated_length ** length_penalty, an EOS that ended it not counted."""
    tokens = hypothesis.tokens
    ended_by_eos = hypothesis.finish_reason == "stop" and tokens and tokens[-1] in eos_token_ids
    length = len(tokens) - (1 if ended_by_eos else 0)
    return hypothesis.cum_logprob / max(length, 1) ** length_penalty


@dataclass
class BeamSearchDriver:
    """One prompt's beam search. `request(...)` gives the core requests to add; the engine hands
    each of their outputs to `take`, and calls `advance` once `ready`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: BeamSearchParams
    max_tokens: int  # as the context leaves room for
    eos_token_ids: frozenset[int]
    cache_salt: str | None = None
    priority: int = 0  # each beam's, under the priority policy
    live: list[_Beam] = field(default_factory=list)
    done: list[Hypothesis] = field(default_factory=list)
    error: str | None = None
    _pending: set[str] = field(default_factory=set)  # live beams whose output is still to come
    _ids: itertools.count = field(default_factory=itertools.count)

    @property
    def sampling(self) -> SamplingParams:
        """A beam's: greedy with the top 2k logprobs; EOS is the driver's business, not the scheduler's."""
        return SamplingParams(
            temperature=0, max_tokens=1, logprobs=2 * self.params.beam_width, ignore_eos=True, detokenize=False
        )

    def start(self) -> list[EngineCoreRequest]:
        return [self._beam([], 0.0, None)]

    def take(self, output: EngineCoreOutput) -> None:
        """A beam's output: its next position's logprobs (or the error that ends the search)."""
        if output.error is not None:
            self.error = self.error or output.error
        elif output.finish_reason is not None and output.request_id in self._pending:
            self._pending.discard(output.request_id)
            beam = next(b for b in self.live if b.request_id == output.request_id)
            assert output.new_logprobs is not None  # (a beam asks for them)
            beam.next_logprobs = output.new_logprobs[0]

    @property
    def ready(self) -> bool:
        """Every live beam has its output (or the search failed): time to advance."""
        return self.error is not None or (bool(self.live) and not self._pending)

    @property
    def finished(self) -> bool:
        return self.error is not None or not self.live

    def advance(self) -> tuple[list[EngineCoreRequest], list[str]]:
        """The next beams' core requests, and the ids of the beams to release (their parents)."""
        k = self.params.beam_width
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        candidates = sorted(self._candidates(), key=lambda c: c[0], reverse=True)
        chosen: list[tuple[float, _Beam, int]] = []
        for rank, (cum, beam, token) in enumerate(candidates):
            if token in eos:
                if rank < k:
                    self.done.append(Hypothesis(beam.tokens + [token], cum, "stop"))
                continue
            chosen.append((cum, beam, token))
            if len(chosen) == k:
                break
        if len(self.live[0].tokens) + 1 >= self.max_tokens:
            self.done += [Hypothesis(beam.tokens + [token], cum, "length") for cum, beam, token in chosen]
            chosen = []
        released = self.release()
        new = [self._beam(beam.tokens + [token], cum, beam.request_id) for cum, beam, token in chosen]
        return new, released

    def release(self) -> list[str]:
        """End the search's live beams: the ids of their core requests."""
        ids = [beam.request_id for beam in self.live]
        self.live, self._pending = [], set()
        return ids

    def core_request_ids(self) -> list[str]:
        return [beam.request_id for beam in self.live]

    def best(self) -> list[Hypothesis]:
        """The beam_width best hypotheses, best first."""
        return sorted(self.done, key=self.score, reverse=True)[: self.params.beam_width]

    def score(self, hypothesis: Hypothesis) -> float:
        return beam_score(hypothesis, self.eos_token_ids, self.params.length_penalty)

    def output(self, decode: Callable[[list[int]], str]) -> RequestOutput:
        """The request's one output: its best beams as completions (`decode(ids)`: their text)."""
        if self.error is not None:
            return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, None, [], True, error=self.error)
        outputs = [
            CompletionOutput(i, decode(h.tokens), h.tokens, h.cum_logprob, None, h.finish_reason)
            for i, h in enumerate(self.best())
        ]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, None, outputs, True)

    def _beam(self, tokens: list[int], cum_logprob: float, parent: str | None) -> EngineCoreRequest:
        """A beam asking for its next position: one held token after the prompt and its tokens."""
        beam = _Beam(f"{self.request_id}-beam{next(self._ids)}", tokens, cum_logprob)
        self.live.append(beam)
        self._pending.add(beam.request_id)
        return EngineCoreRequest(
            beam.request_id,
            self.prompt_token_ids + tokens,
            self.sampling,
            1,
            self.eos_token_ids,
            self.cache_salt,
            hold=True,
            fork_of=parent,
            priority=self.priority,
        )

    def _candidates(self):
        for beam in self.live:
            logprobs, seen = beam.next_logprobs, set()
            assert logprobs is not None  # (ready: every live beam has them)
            for token, value in zip(logprobs.token_ids, logprobs.logprobs):
                if token not in seen:  # the chosen token comes first, then again in the top k
                    seen.add(token)
                    yield beam.cum_logprob + value, beam, token
