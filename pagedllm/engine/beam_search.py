"""Beam search over the engine's requests.

Each beam is a one-token engine-core request that is held when it finishes: it keeps its blocks,
and its output brings the top-2k logprobs of the next position. The driver then takes the k best
continuations across a prompt's beams and starts each as a new request forked from its parent
beam (it shares all the parent's blocks; the partial last one is copied on the first write), and
releases the parents, which frees what only they held. The prompt is computed once. The driver
talks to the engine core only through its messages (LLMEngine.add_driven_request).

Selection follows Hugging Face's beam search: candidates ranked by cumulative logprob; an EOS
candidate ranked within the top k ends a hypothesis; hypotheses are scored at the end by
cum_logprob / generated_length ** length_penalty.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from pagedllm.core.messages import EngineCoreOutput, TokenLogprobs
from pagedllm.engine.llm_engine import LLMEngine, ProcessedRequest
from pagedllm.outputs import BeamSearchOutput, BeamSearchSequence
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class _Beam:
    request_id: str
    tokens: list[int]  # generated so far
    cum_logprob: float
    next_logprobs: TokenLogprobs | None = None  # of the position after `tokens`, once computed


@dataclass
class _Group:
    processed: ProcessedRequest
    live: list[_Beam]
    done: list[tuple[list[int], float, str]] = field(default_factory=list)  # tokens, cum_logprob, reason


class BeamSearch:
    def __init__(self, engine: LLMEngine, params: BeamSearchParams) -> None:
        self.engine = engine
        self.params = params
        self._ids = (f"beam-{i}" for i in itertools.count())
        # Greedy with the top 2k logprobs; EOS is the driver's business, not the scheduler's.
        self.sampling = SamplingParams(
            temperature=0,
            max_tokens=params.max_tokens,
            logprobs=2 * params.beam_width,
            ignore_eos=True,
            detokenize=False,
        )
        self._live: dict[str, _Beam] = {}  # request id -> beam, while its step is to come
        self._error: str | None = None

    def run(self, prompts: list[str | list[int]]) -> list[BeamSearchOutput]:
        groups = [self._start(self.engine.process_inputs(p, self.sampling)) for p in prompts]
        try:
            while any(g.live for g in groups):
                while self._live:
                    self.engine.step()
                    if self._error is not None:
                        raise RuntimeError(f"beam search failed: {self._error}")
                for group in groups:
                    if group.live:
                        self._advance(group)
        finally:
            for group in groups:  # an error half-way still frees every beam
                self._drop(group.live)
        return [self._output(g) for g in groups]

    def _start(self, processed: ProcessedRequest) -> _Group:
        beam = _Beam(next(self._ids), [], 0.0)
        self._submit(beam, processed, None)
        return _Group(processed, [beam])

    def _submit(self, beam: _Beam, processed: ProcessedRequest, parent: str | None) -> None:
        """Ask for the beam's next position: one held token after the prompt and the beam's tokens."""
        prompt = dataclasses.replace(processed, prompt_token_ids=processed.prompt_token_ids + beam.tokens, max_tokens=1)
        self._live[beam.request_id] = beam
        self.engine.add_driven_request(
            self.engine.core_request(beam.request_id, prompt, self.sampling, hold=True, fork_of=parent), self._on_output
        )

    def _on_output(self, output: EngineCoreOutput) -> None:
        if output.error is not None:
            self._error = output.error
        elif output.finish_reason is not None:
            self._live.pop(output.request_id).next_logprobs = output.new_logprobs[0]

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
            child = _Beam(next(self._ids), beam.tokens + [token], cum)
            self._submit(child, group.processed, beam.request_id)
            new_live.append(child)
        self._drop(group.live)
        group.live = new_live

    def _candidates(self, beams: list[_Beam]):
        for beam in beams:
            logprobs, seen = beam.next_logprobs, set()
            for token, value in zip(logprobs.token_ids, logprobs.logprobs):
                if token not in seen:  # the chosen token comes first, then again in the top k
                    seen.add(token)
                    yield beam.cum_logprob + value, beam, token

    def _drop(self, beams: list[_Beam]) -> None:
        for beam in beams:
            self._live.pop(beam.request_id, None)
        self.engine.finish_core_requests([beam.request_id for beam in beams])

    def _output(self, group: _Group) -> BeamSearchOutput:
        eos = self.engine.model_config.eos_token_ids
        tokenizer = self.engine.tokenizer

        def score(tokens: list[int], cum: float, reason: str) -> float:
            length = len(tokens) - (1 if reason == "stop" and tokens[-1] in eos else 0)
            return cum / max(length, 1) ** self.params.length_penalty

        ranked = sorted(group.done, key=lambda d: score(*d), reverse=True)[: self.params.beam_width]
        prompt_ids = group.processed.prompt_token_ids
        sequences = [
            BeamSearchSequence(
                prompt_ids + tokens,
                tokenizer.decode(tokens, skip_special_tokens=True),
                cum,
                score(tokens, cum, reason),
                reason,
            )
            for tokens, cum, reason in ranked
        ]
        return BeamSearchOutput(group.processed.prompt, prompt_ids, sequences)
