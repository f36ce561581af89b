"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedllm.entrypoints.openai.protocol import APIError, CompletionRequest
from pagedllm.entrypoints.openai.serving import Choice, OpenAIServing, Run, accumulate, new_id, top_entries, usage
from pagedllm.outputs import Logprob


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest):
        lora = self.check_model(request.model)
        self.check_task("generate")
        if request.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if request.best_of not in (None, request.n):
            raise APIError("best_of must equal n (or be left out)", param="best_of")
        prompts = _prompt_list(request.prompt)
        echo_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
        constraint, field = request.constraint()
        params = (
            request.beam_search_params(request.max_tokens, self.engine.max_model_len)
            if request.use_beam_search
            else request.sampling_params(self.defaults, request.max_tokens, request.logprobs, echo_logprobs, constraint)
        )
        processed = await self.admit(
            prompts, params, request.max_tokens, request.cache_salt, field, lora, request.priority
        )
        request_id = new_id("cmpl")
        streams = self.start(request_id, processed)
        prompt_texts = [
            p.prompt if p.prompt is not None else self.engine.tokenizer.decode(p.prompt_token_ids) for p in processed
        ]
        run = _Run(self, request, request_id, prompt_texts, [p.prompt_token_ids for p in processed])
        return await self.respond(request.stream, run, streams)


class _Run(Run):
    """One completion request's outputs, turned into OpenAI's response or chunks."""

    object_name = "text_completion"

    def __init__(
        self,
        serving: OpenAIServingCompletion,
        request: CompletionRequest,
        request_id: str,
        prompt_texts: list[str],
        prompt_ids: list[list[int]],
    ) -> None:
        super().__init__(serving, request, request_id, sum(map(len, prompt_ids)))
        self.prompt_texts, self.prompt_ids = prompt_texts, prompt_ids
        self.offsets: dict[int, int] = {}  # choice -> text offset of its next token

    def _index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.request.n + sample_index

    def _echo(self, prompt_index: int, output) -> tuple[str, list[int], list]:
        """What echo puts before a choice's first text: the prompt, its ids, its logprobs."""
        if not self.request.echo:
            return "", [], []
        entries = output.prompt_logprobs or [None] * len(self.prompt_ids[prompt_index])
        return self.prompt_texts[prompt_index], self.prompt_ids[prompt_index], entries

    async def collect(self, outputs: AsyncIterator) -> dict:
        choices: dict[int, Choice] = {}
        prefixes: dict[int, tuple[str, list[int], list]] = {}
        async for prompt_index, output in outputs:
            for sample in output.outputs:
                index = self._index(prompt_index, sample.index)
                if index not in prefixes:
                    prefixes[index] = self._echo(prompt_index, output)
                accumulate(choices, index, sample)
        body = []
        for index in sorted(choices):
            choice = choices[index]
            text, ids, entries = prefixes[index]
            body.append(
                {
                    "index": index,
                    "text": text + choice.text,
                    "logprobs": self._logprobs(index, ids + choice.token_ids, entries + choice.logprobs),
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                }
            )
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": body,
            "usage": usage(self.num_prompt_tokens, completion_tokens),
        }

    async def events(self, outputs: AsyncIterator) -> AsyncIterator[dict]:
        started: set[int] = set()
        async for prompt_index, output in outputs:
            for sample in output.outputs:
                index = self._index(prompt_index, sample.index)
                text, ids, entries = "", [], []
                if index not in started:
                    started.add(index)
                    text, ids, entries = self._echo(prompt_index, output)
                self.completion_tokens += len(sample.token_ids)
                yield self.chunk(
                    [
                        {
                            "index": index,
                            "text": text + sample.text,
                            "logprobs": self._logprobs(
                                index, ids + sample.token_ids, entries + (sample.logprobs or [])
                            ),
                            "finish_reason": sample.finish_reason,
                            "stop_reason": sample.stop_reason,
                        }
                    ]
                )

    def _logprobs(self, index: int, token_ids: list[int], entries: list[dict[int, Logprob] | None]) -> dict | None:
        k = self.request.logprobs
        if k is None:
            return None
        decode = self.serving.logprob_token
        tokens = [decode(t) for t in token_ids]
        offsets = []
        offset = self.offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self.offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [entry[t].logprob if entry else None for t, entry in zip(token_ids, entries)],
            "top_logprobs": [
                None
                if not entry
                else {**{decode(t): lp.logprob for t, lp in top_entries(entry, k)}, decode(token): entry[token].logprob}
                for token, entry in zip(token_ids, entries)
            ],
            "text_offset": offsets,
        }


def _prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt must not be empty", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt)
