"""Beam search over the engine's requests.

Each beam is a request that pauses after every step, holding its blocks and its top-2k logprobs.
The driver then takes the k best continuations across a prompt's beams and forks each from its
parent beam: a fork shares all the parent's blocks (the partial last one is copied on the first
write), and the parents are then dropped, which frees what only they held. The prompt is
computed once.

Selection follows Hugging Face's beam search: candidates ranked by cumulative logprob; an EOS
candidate ranked within the top k ends a hypothesis; hypotheses are scored at the end by
cum_logprob / generated_length ** length_penalty.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pagedllm.core.request import RequestStatus
from pagedllm.engine.llm_engine import LLMEngine, ProcessedRequest
from pagedllm.outputs import BeamSearchOutput, BeamSearchSequence
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class _Beam:
    request_id: str
    tokens: list[int]  # generated so far
    cum_logprob: float


@dataclass
class _Group:
    processed: ProcessedRequest
    live: list[_Beam]
    done: list[tuple[list[int], float, str]] = field(default_factory=list)  # tokens, cum_logprob, reason


class BeamSearch:
    def __init__(self, engine: LLMEngine, params: BeamSearchParams) -> None:
        self.engine = engine
        self.params = params
        self.scheduler = engine.scheduler
        self._ids = (f"beam-{i}" for i in itertools.count())
        # Greedy with the top 2k logprobs; EOS is the driver's business, not the scheduler's.
        self.sampling = SamplingParams(temperature=0, max_tokens=params.max_tokens, logprobs=2 * params.beam_width,
                                       ignore_eos=True, detokenize=False)

    def run(self, prompts: list[str | list[int]]) -> list[BeamSearchOutput]:
        groups = [self._start(self.engine.process_inputs(p, self.sampling)) for p in prompts]
        try:
            while any(g.live for g in groups):
                while self.scheduler.has_unfinished_requests():
                    self.engine.step()
                    self._raise_failures(groups)
                for group in groups:
                    if group.live:
                        self._advance(group)
        finally:
            for group in groups:  # an error half-way still frees every beam
                self._drop(group.live)
        return [self._output(g) for g in groups]

    def _raise_failures(self, groups: list[_Group]) -> None:
        for group in groups:
            for beam in group.live:
                error = self.engine.failed_requests.pop(beam.request_id, None)
                if error is not None:
                    group.live.remove(beam)  # the engine has ended it already
                    raise RuntimeError(f"beam search failed: {error}")

    def _start(self, processed: ProcessedRequest) -> _Group:
        request_id = next(self._ids)
        request = self.engine.engine_core.add_request(self.engine.core_request(request_id, processed, self.sampling))
        request.pause_after_sample = True
        return _Group(processed, [_Beam(request_id, [], 0.0)])

    def _advance(self, group: _Group) -> None:
        k = self.params.beam_width
        eos = self.engine.model_config.eos_token_ids if not self.params.ignore_eos else frozenset()
        candidates = sorted(self._candidates(group.live), key=lambda c: c[0], reverse=True)
        chosen: list[tuple[float, _Beam, int]] = []
        for rank, (cum, beam, token) in enumerate(candidates):
            if token in eos:
                if rank < k:
                    group.done.append((beam.tokens + [token], cum, "stop"))
                continue
            chosen.append((cum, beam, token))
            if len(chosen) == k:
                break
        last = len(group.live[0].tokens) + 1 >= group.processed.max_tokens
        if last:
            group.done += [(beam.tokens + [token], cum, "length") for cum, beam, token in chosen]
            chosen = []
        new_live = []
        for cum, beam, token in chosen:
            child = self.scheduler.fork_paused(beam.request_id, next(self._ids), token)
            new_live.append(_Beam(child.request_id, beam.tokens + [token], cum))
        self._drop(group.live)
        group.live = new_live

    def _candidates(self, beams: list[_Beam]):
        for beam in beams:
            logprobs = self.scheduler.paused[beam.request_id].last_logprobs
            seen = set()
            for token, value in zip(logprobs.token_ids, logprobs.logprobs):
                if token not in seen:  # the chosen token comes first, then again in the top k
                    seen.add(token)
                    yield beam.cum_logprob + value, beam, token

    def _drop(self, beams: list[_Beam]) -> None:
        for beam in beams:
            self.scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_ABORTED)

    def _output(self, group: _Group) -> BeamSearchOutput:
        eos = self.engine.model_config.eos_token_ids
        tokenizer = self.engine.tokenizer

        def score(tokens: list[int], cum: float, reason: str) -> float:
            length = len(tokens) - (1 if reason == "stop" and tokens[-1] in eos else 0)
            return cum / max(length, 1) ** self.params.length_penalty

        ranked = sorted(group.done, key=lambda d: score(*d), reverse=True)[: self.params.beam_width]
        prompt_ids = group.processed.prompt_token_ids
        sequences = [BeamSearchSequence(prompt_ids + tokens, tokenizer.decode(tokens, skip_special_tokens=True),
                                        cum, score(tokens, cum, reason), reason) for tokens, cum, reason in ranked]
        return BeamSearchOutput(group.processed.prompt, prompt_ids, sequences)
