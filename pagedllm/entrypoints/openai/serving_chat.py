"""POST /v1/chat/completions."""
from __future__ import annotations

from collections.abc import AsyncIterator

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.chat_utils import apply_chat_template
from pagedllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, ChatMessage
from pagedllm.entrypoints.openai.serving import (Choice, OpenAIServing, Run, accumulate, new_id, off_loop,
                                                 top_entries, usage)
from pagedllm.outputs import Logprob


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, model_name: str, chat_template: str | None,
                 request_timeout: float | None = None) -> None:
        super().__init__(engine, model_name, request_timeout)
        self.chat_template = chat_template

    async def prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        """The conversation's prompt token ids, rendered and tokenized off the event loop."""
        return await off_loop(self._prompt_ids, messages, add_generation_prompt)

    def _prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        try:
            return apply_chat_template(self.engine.tokenizer, [m.as_template_input() for m in messages],
                                       self.chat_template, add_generation_prompt)
        except ValueError as exc:
            raise APIError(str(exc), param="messages") from exc
        except Exception as exc:  # a template that fails on these messages (jinja raises its own types)
            raise APIError(f"the chat template could not render these messages: {exc}", param="messages") from exc

    async def create(self, request: ChatCompletionRequest):
        self.check_model(request.model)
        max_tokens = request.max_completion_tokens or request.max_tokens
        top = request.top_logprobs if request.logprobs else None
        if request.logprobs and top is None:
            top = 0
        params = request.sampling_params(self.defaults, max_tokens, top, None)
        prompt = await self.prompt_ids(request.messages, request.add_generation_prompt)
        processed = await self.admit([prompt], params, max_tokens, request.cache_salt)
        request_id = new_id("chatcmpl")
        streams = self.start(request_id, processed)
        run = _Run(self, request, request_id, len(prompt))
        return await self.respond(request.stream, run, streams)


class _Run(Run):
    object_name = "chat.completion.chunk"

    async def collect(self, outputs: AsyncIterator) -> dict:
        choices: dict[int, Choice] = {}
        async for _, output in outputs:
            for sample in output.outputs:
                accumulate(choices, sample.index, sample)
        body = [{"index": i, "message": {"role": "assistant", "content": c.text},
                 "logprobs": self._logprobs(c.token_ids, c.logprobs), "finish_reason": c.finish_reason,
                 "stop_reason": c.stop_reason} for i, c in sorted(choices.items())]
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.serving.model_name, "choices": body,
                "usage": usage(self.num_prompt_tokens, completion_tokens)}

    async def events(self, outputs: AsyncIterator) -> AsyncIterator[dict]:
        for index in range(self.request.n):  # the role first, for every choice
            yield self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}])
        async for _, output in outputs:
            for sample in output.outputs:
                self.completion_tokens += len(sample.token_ids)
                if sample.text or sample.token_ids:
                    yield self.chunk([{"index": sample.index, "delta": {"content": sample.text},
                                       "logprobs": self._logprobs(sample.token_ids, sample.logprobs or []),
                                       "finish_reason": None}])
                if sample.finish_reason is not None:  # the finish reason last, with an empty delta
                    yield self.chunk([{"index": sample.index, "delta": {}, "logprobs": None,
                                       "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason}])

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]]) -> dict | None:
        if not self.request.logprobs:
            return None
        k = self.request.top_logprobs or 0
        decode = self.serving.logprob_token

        def item(token: int, logprob: float) -> dict:
            text = decode(token)
            return {"token": text, "logprob": logprob, "bytes": list(self.serving.token_bytes(token))}

        return {"content": [{**item(t, entry[t].logprob),
                             "top_logprobs": [item(tok, lp.logprob) for tok, lp in top_entries(entry, k)]}
                            for t, entry in zip(token_ids, entries)]}
