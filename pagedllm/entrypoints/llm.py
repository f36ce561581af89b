"""LLM: the offline API, shaped like vLLM's (`LLM(model).generate(prompts, SamplingParams(...))`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedllm.config import EngineArgs
from pagedllm.engine.beam_search import Hypothesis, beam_score
from pagedllm.engine.llm_engine import LLMEngine, ProcessedRequest
from pagedllm.entrypoints.chat_utils import Message, apply_chat_template
from pagedllm.entrypoints.score_utils import cosine, score_pairs
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.processing import ImagePrompt, image_prompt
from pagedllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict | ImagePrompt
EngineParams = SamplingParams | PoolingParams | BeamSearchParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(f"unknown LLM arguments: {sorted(unknown)}")
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.
        `lora_request`: the adapter every prompt runs under, or one per prompt (enable_lora=True).
        `priority`: one per prompt, lower first (scheduling_policy="priority")."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts), self.get_default_sampling_params)
        normalized = [_prompt_input(p) for p in prompts]
        loras = _as_lora_list(lora_request, len(prompts))
        priorities = self._priorities(priority, len(prompts))
        for p in params:  # validate everything before anything is queued
            self.engine.check_params(p)
        for lora in set(loras) - {None}:
            self.engine.check_lora(lora)
        # One output per request, at its end: no per-step copies of growing outputs.
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        return self._run(normalized, params, use_tqdm, loras, priorities)

    def _priorities(self, priority: Sequence[int] | None, count: int) -> list[int]:
        """One priority per prompt (vLLM's `priority` list), each checked against the policy."""
        if priority is None:
            return [0] * count
        priorities = list(priority)
        if len(priorities) != count:
            raise ValueError(f"{len(priorities)} priorities for {count} prompts")
        for value in priorities:
            self.engine.check_priority(value)
        return priorities

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`output.outputs.embedding`), in the order of the prompts. The
        model's pooling (sentence-transformers' modules, else its family's default) applies;
        `pooling_params` may ask for fewer dimensions (Matryoshka models) or no normalization."""
        prompts = [_prompt_input(p) for p in _as_prompt_list(prompts)]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        params = list(pooling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} pooling params for {len(prompts)} prompts")
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        priorities = self._priorities(priority, len(prompts))
        for p in params:
            self.engine.check_params(p)
        outputs = self._run(prompts, params, use_tqdm, priorities=priorities)
        _raise_failed(outputs, "embedding")
        return outputs

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Conversations through the chat template (with `tools`, OpenAI's tool definitions, where
        the template takes them), then generate. The output is the model's text: reading tool calls
        out of it is the server's job (--tool-call-parser)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            apply_chat_template(
                self.engine.tokenizer,
                c,
                chat_template,
                add_generation_prompt,
                tools,
                chat_template_kwargs,
                self.engine.args.allowed_local_media_path,
                self.engine.images is not None,
                (self.engine.args.limit_mm_per_prompt or {}).get("image"),
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request, priority)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """The beam_width best continuations of each prompt, best first (see engine/beam_search.py)."""
        prompts = [_prompt_input(p) for p in _as_prompt_list(prompts)]
        self.engine.check_params(params)
        outputs = self._run(prompts, [params] * len(prompts), use_tqdm=False)
        failed = [o for o in outputs if o.error is not None]
        if failed:
            raise RuntimeError(f"beam search failed: {failed[0].error}")
        eos = self.engine.model_config.eos_token_ids
        return [_beam_search_output(o, params, eos) for o in outputs]

    def score(
        self,
        data_1: str | list[str],
        data_2: str | list[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """Each pair's score (vLLM's pairing: one text against each of the others, or N with N): a
        cross-encoder's relevance (BertForSequenceClassification), else the cosine of the two
        texts' embeddings (an embedding model)."""
        pairs = score_pairs(data_1, data_2)
        engine = self.engine
        if "score" in engine.model_config.supported_tasks:
            params = PoolingParams(task="score", truncate_prompt_tokens=truncate_prompt_tokens)
            processed = [engine.process_pair(a, b, params) for a, b in pairs]
            outputs = self._run_processed(processed, use_tqdm)
            _raise_failed(outputs, "scoring")
            return [
                ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.embedding[0]), o.prompt_token_ids)
                for o in outputs
            ]
        engine.check_task("embed")
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        vectors = dict(zip(texts, self.embed(texts, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)))
        return [
            ScoringRequestOutput(
                str(i),
                ScoringOutput(cosine(vectors[a].outputs.embedding, vectors[b].outputs.embedding)),
                vectors[a].prompt_token_ids + vectors[b].prompt_token_ids,
            )
            for i, (a, b) in enumerate(pairs)
        ]

    def classify(
        self, prompts: Prompt | Sequence[Prompt], *, use_tqdm: bool = True
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities (a sequence-classification model; its labels are
        `config.id2label`)."""
        inputs = [_prompt_input(p) for p in _as_prompt_list(prompts)]
        params = PoolingParams(task="classify")
        self.engine.check_params(params)
        outputs = self._run(inputs, [params] * len(inputs), use_tqdm)
        _raise_failed(outputs, "classification")
        return [
            ClassificationRequestOutput(o.request_id, ClassificationOutput(o.outputs.embedding), o.prompt_token_ids)
            for o in outputs
        ]

    def _run(
        self,
        prompts: list[str | list[int] | ImagePrompt],
        params: Sequence[EngineParams],
        use_tqdm: bool,
        loras: Sequence[LoRARequest | None] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list:
        """Every prompt validated, then through the engine's loop until all are done."""
        count = len(prompts)
        processed = [
            dataclasses.replace(self.engine.process_inputs(prompt, p, lora), priority=priority)
            for prompt, p, lora, priority in zip(prompts, params, loras or [None] * count, priorities or [0] * count)
        ]
        return self._run_processed(processed, use_tqdm)

    def _run_processed(self, processed: list[ProcessedRequest], use_tqdm: bool) -> list:
        """Validated requests through the engine's loop (LLMEngine.run) until all are done."""
        engine = self.engine
        ids: list[str] = []
        try:
            for item in processed:
                ids.append(engine.add_processed(None, item))
            done: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
            with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:

                def collect(outputs: list[RequestOutput | EmbeddingRequestOutput]) -> None:
                    for output in outputs:
                        if output.finished:
                            done[output.request_id] = output
                            bar.update(1)

                engine.run(collect)
        except BaseException:
            for request_id in ids:  # leave the engine clean for the next call
                engine.abort_request(request_id)
            raise
        return [done[i] for i in ids]


def _raise_failed(outputs: list, what: str) -> None:
    failed = [o for o in outputs if o.error is not None]
    if failed:
        raise RuntimeError(f"{what} request {failed[0].request_id} failed: {failed[0].error}")


def _beam_search_output(output: RequestOutput, params: BeamSearchParams, eos: frozenset[int]) -> BeamSearchOutput:
    sequences = [
        BeamSearchSequence(
            output.prompt_token_ids + beam.token_ids,
            beam.text,
            beam.cumulative_logprob,
            beam_score(
                Hypothesis(beam.token_ids, beam.cumulative_logprob, beam.finish_reason), eos, params.length_penalty
            ),
            beam.finish_reason,
        )
        for beam in output.outputs
    ]
    return BeamSearchOutput(output.prompt, output.prompt_token_ids, sequences)


def _as_lora_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"{len(loras)} LoRA requests for {count} prompts")
    return loras


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict, ImagePrompt)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _prompt_input(prompt: Prompt) -> str | list[int] | ImagePrompt:
    if isinstance(prompt, dict):
        if "multi_modal_data" in prompt:
            return image_prompt(prompt)
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return prompt


def _as_params_list(params, count: int, default) -> list[SamplingParams]:
    if params is None:
        return [default() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return params
