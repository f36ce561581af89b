"""OutputProcessor: per-step model results -> RequestOutputs (text, logprobs, finish reasons).

It owns each request's detokenizer; a stop string found here ends the request, which the engine
then tells the scheduler. Parallel samples (n > 1) are n scheduler requests gathered back into
one RequestOutput. An embedding request's one output carries its vector.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from pagedllm.core.messages import EngineCoreOutput, TokenLogprobs
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
)
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import PerThreadTokenizer


@dataclass
class _Sample:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # How much has been handed out already (DELTA outputs send only the rest).
    sent_tokens: int = 0
    sent_text: int = 0
    sent_finish: bool = False

    def text(self) -> str:
        return self.detokenizer.visible_text(self.finish_reason is not None) if self.detokenizer else ""


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[str, _Sample]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_prompt_logprobs: bool = False
    queue_time: float | None = None  # seconds from arrival to first scheduled

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizers: PerThreadTokenizer) -> None:
        self.tokenizers = tokenizers
        self.parents: dict[str, _Parent] = {}
        self.parent_of: dict[str, str] = {}  # scheduler request id -> parent id
        self.embeddings: dict[str, list[int]] = {}  # embedding request id -> its prompt's ids

    def in_use(self, request_id: str) -> bool:
        return request_id in self.parents or request_id in self.embeddings

    def add_pooling(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.embeddings[request_id] = prompt_token_ids

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: list[str],
    ) -> None:
        samples = {
            cid: _Sample(
                i,
                self._detokenizer(prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for i, cid in enumerate(child_ids)
        }
        prompt_logprobs: PromptLogprobs | None = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] * len(prompt_token_ids)
        self.parents[request_id] = _Parent(request_id, prompt, prompt_token_ids, params, samples, prompt_logprobs)
        for cid in child_ids:
            self.parent_of[cid] = request_id

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if not params.detokenize:
            return None
        return IncrementalDetokenizer(
            self.tokenizers.get(),
            prompt_token_ids,
            cast(list[str], params.stop),  # a list once checked (SamplingParams.__post_init__)
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.samples) if parent else []

    def abort(self, request_id: str) -> None:
        self.embeddings.pop(request_id, None)
        parent = self.parents.pop(request_id, None)
        for cid in parent.samples if parent else ():
            self.parent_of.pop(cid, None)

    def fail(self, request_id: str, error: str) -> RequestOutput | EmbeddingRequestOutput | None:
        """The final output of a request that failed: every unfinished sample ends with "error"."""
        if request_id in self.embeddings:
            return EmbeddingRequestOutput(request_id, None, self.embeddings.pop(request_id), error=error)
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for sample in parent.samples.values():
            if sample.finish_reason is None:
                sample.finish_reason = "error"
        output = self._output(parent)
        if output is not None:
            output.error = error
        return output

    def process(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput | EmbeddingRequestOutput], list[str]]:
        """Returns the outputs to hand out and the core's request ids that a stop string finished."""
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        embedded: list[EmbeddingRequestOutput] = []
        for core in core_outputs:
            if core.request_id in self.embeddings:
                if core.finish_reason is not None:
                    embedded.append(self._embedding(core))
                continue
            parent = self.parents.get(self.parent_of.get(core.request_id, core.request_id))
            if parent is None:
                continue
            self._record_prompt_logprobs(parent, core.new_prompt_logprobs)
            if parent.queue_time is None:
                parent.queue_time = core.queue_time
            sample = parent.samples[core.request_id]
            new = core.new_token_ids
            if new and self._record_tokens(sample, new, core.new_logprobs):
                stopped.append(core.request_id)
            elif core.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = core.finish_reason, core.stop_reason
            elif not new:
                continue  # a prefill chunk: nothing to tell yet
            touched[parent.request_id] = parent
        outputs = [self._output(p) for p in touched.values()]
        return [o for o in outputs if o is not None] + embedded, stopped

    def _embedding(self, core: EngineCoreOutput) -> EmbeddingRequestOutput:
        prompt_token_ids = self.embeddings.pop(core.request_id)
        if core.pooled is None:  # ended without being computed (aborted in the core)
            return EmbeddingRequestOutput(
                core.request_id,
                None,
                prompt_token_ids,
                error=f"the request ended ({core.finish_reason}) before its prompt was pooled",
            )
        return EmbeddingRequestOutput(core.request_id, EmbeddingOutput(core.pooled.tolist()), prompt_token_ids)

    def _record_tokens(self, sample: _Sample, tokens: list[int], logprobs: list[TokenLogprobs] | None) -> bool:
        """True if a stop string ended the sample (the tokens after it are dropped)."""
        for i, token in enumerate(tokens):
            if self._record_token(sample, token, logprobs[i] if logprobs else None):
                return True
        return False

    def _record_token(self, sample: _Sample, token: int, logprobs: TokenLogprobs | None) -> bool:
        sample.token_ids.append(token)
        if logprobs is not None and sample.logprobs is not None:
            sample.logprobs.append(self._logprob_dict(logprobs))
            sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + logprobs.logprobs[0]
        stop = sample.detokenizer.update(token) if sample.detokenizer else None
        if stop is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop
            return True
        return False

    def _record_prompt_logprobs(self, parent: _Parent, chunk: tuple[int, list[TokenLogprobs]] | None) -> None:
        if chunk is None or parent.prompt_logprobs is None:
            return
        start, entries = chunk
        for offset, entry in enumerate(entries):
            parent.prompt_logprobs[start + offset] = self._logprob_dict(entry)

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        out: dict[int, Logprob] = {}
        for token, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token not in out:
                out[token] = Logprob(logprob, rank, str(self.tokenizers.get().decode([token])))
        return out

    def _output(self, parent: _Parent) -> RequestOutput | None:
        finished = parent.finished
        kind = parent.params.output_kind
        if finished:
            self.abort(parent.request_id)
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        samples = [s for s in parent.samples.values() if not delta or _has_news(s)]
        outputs = [_completion(s, delta) for s in samples]
        prompt_logprobs = parent.prompt_logprobs
        if delta and parent.sent_prompt_logprobs:
            prompt_logprobs = None
        parent.sent_prompt_logprobs = True
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            prompt_logprobs,
            outputs,
            finished,
            {"queue_time": parent.queue_time},
        )


def _has_news(sample: _Sample) -> bool:
    return (
        len(sample.token_ids) > sample.sent_tokens
        or len(sample.text()) > sample.sent_text
        or (sample.finish_reason is not None and not sample.sent_finish)
    )


def _completion(sample: _Sample, delta: bool) -> CompletionOutput:
    """The sample as a CompletionOutput: everything so far, or (delta) only what is new."""
    text = sample.text()
    first_token, first_char = (sample.sent_tokens, sample.sent_text) if delta else (0, 0)
    sample.sent_tokens, sample.sent_text = len(sample.token_ids), len(text)
    sample.sent_finish = sample.finish_reason is not None
    return CompletionOutput(
        index=sample.index,
        text=text[first_char:],
        token_ids=sample.token_ids[first_token:],
        cumulative_logprob=sample.cumulative_logprob,
        logprobs=sample.logprobs[first_token:] if sample.logprobs is not None else None,
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason,
    )
