"""LLMEngine: the synchronous engine's frontend. Prompts in, one step at a time, RequestOutputs out.

It tokenizes and validates, fans n > 1 out into samples, and turns the engine core's plain
outputs (engine/engine_core.py) into text, stop strings and RequestOutputs. It reaches the core
only through messages: requests in (add, finish), outputs out of each step.

Parallel samples share their prompt's KV blocks: a held request computes the prompt but its last
token, then each sample forks from it (core/scheduler.py) and computes that token itself, which
gives it logits to draw its own first token from.

An embedding request (PoolingParams in place of SamplingParams) is a core request with
max_tokens 0 that carries its pooling parameters: the core computes its prompt, the worker pools
it, and its one output is an EmbeddingRequestOutput.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.config import EngineArgs
from pagedllm.core.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from pagedllm.core.request import RequestStatus
from pagedllm.core.snapshot import EngineSnapshot
from pagedllm.engine.beam_search import BeamSearchDriver
from pagedllm.engine.builder import load_config, make_client
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.faults import FaultInjector
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.lora.adapter import AdapterInfo, check_adapter, read_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal import MultiModalFeature
from pagedllm.multimodal.processing import ImageProcessor, ImagePrompt, tokens_per_image
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, InvalidParamError, SamplingParams
from pagedllm.structured_output.xgrammar_backend import XgrammarBackend
from pagedllm.tokenizer import PerThreadTokenizer, load_tokenizer

if TYPE_CHECKING:  # annotations, not imports the frontend makes
    from transformers import PreTrainedTokenizerBase

    from pagedllm.engine.engine_core import EngineCore
    from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")
# What the core and worker hold as an embedding request's sampling parameters: nothing is sampled.
_POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=0, detokenize=False)
_TASK_NAMES = {
    "generate": "text generation (completions, chat)",
    "embed": "embeddings",
    "classify": "classification",
    "score": "scores of text pairs (a cross-encoder)",
}


@dataclass
class ProcessedRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams | BeamSearchParams
    max_tokens: int
    cache_salt: str | None = None
    mm_features: tuple[MultiModalFeature, ...] = ()
    lora_request: LoRARequest | None = None
    priority: int = 0  # under --scheduling-policy priority: lower runs first


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.model_config = load_config(args)
        self.tokenizers = PerThreadTokenizer(load_tokenizer(self.model_config, args.tokenizer))
        hf = self.model_config.hf_config
        self.images = (
            ImageProcessor(self.model_config.path, hf, self.tokenizers.get, self.model_config.mmproj)
            if tokens_per_image(hf, self.model_config.path, self.model_config.mmproj)
            else None
        )
        self.max_model_len = self.model_config.max_model_len
        self.engine_core: EngineCoreClient = make_client(args, self.model_config, self.tokenizers.get)
        self.output_processor = OutputProcessor(self.tokenizers)
        self._ids = itertools.count()
        # Held prompts of parallel samples -> the samples to fork from them once computed.
        self._forks: dict[str, list[EngineCoreRequest]] = {}
        # Beam searches: request id -> its driver, and each live beam's core request id -> the request's.
        self._beams: dict[str, BeamSearchDriver] = {}
        self._beam_of: dict[str, str] = {}
        # LoRA adapters checked against the model, by id: (their request, what they update).
        self._adapters: dict[int, tuple[LoRARequest, AdapterInfo]] = {}

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The calling thread's own copy of the model's tokenizer (pagedllm/tokenizer.py)."""
        return self.tokenizers.get()

    # -- test hooks: where the core runs in this thread (else RuntimeError) ----------------------
    @property
    def core(self) -> EngineCore:
        """The engine core itself: its scheduler, KV cache manager and executor."""
        return self.engine_core.core

    @property
    def model_runner(self) -> ModelRunner:
        """The model runner of a one-rank executor in this process: the model and its KV cache."""
        return self.core.executor.driver_worker.model_runner  # type: ignore[attr-defined]

    @property
    def faults(self) -> FaultInjector:
        """The core's fault injector (tests set faults on it)."""
        return self.core.faults

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int] | ImagePrompt,
        params: SamplingParams | PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue one request (n > 1 becomes n sequences); returns its id."""
        return self.add_processed(request_id, self.process_inputs(prompt, params, lora_request))

    def process_inputs(
        self,
        prompt: str | list[int] | ImagePrompt,
        params: SamplingParams | PoolingParams | BeamSearchParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Tokenize and validate; raises ValueError. Touches no engine state but the cache of checked
        adapters, so any thread may call it."""
        if lora_request is not None:
            self.check_lora(lora_request)
            if not isinstance(params, SamplingParams | None):
                raise ValueError("a LoRA adapter runs with sampling requests only (not embeddings or beam search)")
            processed = self.process_inputs(prompt, params)
            return dataclasses.replace(processed, lora_request=lora_request)
        if isinstance(params, PoolingParams):
            if isinstance(prompt, ImagePrompt):
                raise ValueError("embedding requests take no images")
            return self._process_pooling(prompt, params)
        params = params or self.default_sampling_params()
        if isinstance(params, SamplingParams) and params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        self.check_params(params)
        text: str | None
        features: tuple[MultiModalFeature, ...] = ()
        if isinstance(prompt, ImagePrompt):
            if isinstance(params, BeamSearchParams):
                raise ValueError("beam search takes no images yet")
            text, token_ids, features = prompt.prompt, *self._process_images(prompt)
        else:
            text, token_ids = self._tokenize(prompt)
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return ProcessedRequest(text, token_ids, params, max_tokens, mm_features=features)

    def _process_images(self, prompt: ImagePrompt) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """A prompt with images: the model's processor expands and tokenizes it (checked as text is)."""
        if self.images is None:
            raise ValueError(f"this model ({self.model_config.hf_config.model_type}) takes no images")
        limit = (self.args.limit_mm_per_prompt or {}).get("image")
        if limit is not None and len(prompt.images) > limit:
            raise ValueError(f"the prompt has {len(prompt.images)} images; --limit-mm-per-prompt allows {limit}")
        token_ids, features = self.images(prompt)
        self._tokenize(token_ids)  # the checks a prompt's ids get
        return token_ids, features

    def process_pair(self, text_1: str, text_2: str, params: PoolingParams) -> ProcessedRequest:
        """A pair of texts for a cross-encoder ("score"): tokenized together as its tokenizer joins
        a pair ([CLS] a [SEP] b [SEP] for BERT), the second text's tokens of type 1. A pair longer
        than the model takes is an error unless truncate_prompt_tokens cuts the second text."""
        if params.task != "score":
            raise ValueError("a pair of texts is scored (task 'score')")
        self.check_params(params)
        limit = params.truncate_prompt_tokens
        limit = self.max_model_len if limit == -1 else limit
        if limit is not None and limit > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens {limit} exceeds max_model_len ({self.max_model_len})")
        cut = {"truncation": "only_second", "max_length": limit} if limit is not None else {}
        encoded = self.tokenizer(text_1, text_2, **cut)
        types = encoded.get("token_type_ids")
        start = next((i for i, t in enumerate(types) if t == 1), None) if types is not None else None
        params = dataclasses.replace(params, truncate_prompt_tokens=None, token_type_start=start)
        return self._process_pooling(list(encoded["input_ids"]), params)

    def _process_pooling(self, prompt: str | list[int], params: PoolingParams) -> ProcessedRequest:
        self.check_params(params)
        text, token_ids = self._tokenize(prompt, params)
        return ProcessedRequest(text, token_ids, params, 0)

    def check_task(self, task: str) -> None:
        """Raises ValueError if this engine does not serve `task` ("generate" or "embed")."""
        if task not in self.model_config.supported_tasks:
            served = " and ".join(_TASK_NAMES[t] for t in self.model_config.supported_tasks)
            hint = " (start it with --runner pooling, or serve an embedding model)" if task == "embed" else ""
            raise ValueError(f"this model does not serve {_TASK_NAMES[task]}: it serves {served}{hint}")

    def check_params(self, params: SamplingParams | PoolingParams | BeamSearchParams) -> None:
        """What the parameters cannot check alone: that the engine serves their task, token ids
        against the vocabulary, that a structured output's constraint compiles, that `dimensions`
        is a size the model may be cut to (raises ValueError saying why)."""
        if isinstance(params, PoolingParams):
            self.check_task(params.task)
            self._check_dimensions(params.dimensions)
            return
        self.check_task("generate")
        if isinstance(params, BeamSearchParams):
            return
        params.check_vocab(self.model_config.vocab_size)
        self._check_logits_processors(params)
        if params.structured_outputs is not None:
            XgrammarBackend.check(params.structured_outputs)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's reading of bad_words: each word's tokens, and those of the word after a space where
        they differ in their first token and not in length (a word inside a sentence; SentencePiece
        tokenizers give the same ids, or a stray space token first)."""
        encode = self.tokenizer.encode
        ids: list[list[int]] = []
        for word in words:
            plain = encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise InvalidParamError(f"bad_words: {word!r} encodes to no tokens", "bad_words")
            ids.append(plain)
            spaced = encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                ids.append(spaced)
        return ids

    def _check_logits_processors(self, params: SamplingParams) -> None:
        """Processors reach a core in another process pickled: they must be importable there."""
        if not params.logits_processors or not self.args.crosses_processes():
            return
        for processor in params.logits_processors:
            module = getattr(processor, "__module__", None)
            try:
                pickle.dumps(processor)
                ok = module != "__main__"
            except Exception:  # noqa: BLE001 - whatever pickling raises, the answer is the same
                ok = False
            if not ok:
                raise InvalidParamError(
                    f"logits_processors: {processor!r} cannot reach the engine core's process (it is "
                    "pickled there): define it at the top level of an importable module, or run the "
                    "core in this process",
                    "logits_processors",
                )

    def check_priority(self, priority: int) -> None:
        """A priority other than 0 needs the priority policy (vLLM's rule)."""
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**63) <= priority < 2**63:
            raise InvalidParamError(f"priority must be a 64-bit integer, got {priority!r}", "priority")
        if priority != 0 and self.args.scheduling_policy != "priority":
            raise InvalidParamError(
                f"Got priority {priority} but priority scheduling is not enabled "
                "(start the engine with --scheduling-policy priority)",
                "priority",
            )

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        allowed = self.model_config.matryoshka_dimensions
        if allowed is None:
            raise ValueError("this model does not support matryoshka representation: dimensions cannot be set")
        if dimensions not in allowed:
            raise ValueError(
                f"dimensions {dimensions} is not one this model takes "
                f"({allowed[0]}..{allowed[-1]}" + (")" if len(allowed) == allowed[-1] else f": {allowed})")
            )

    def add_processed(self, request_id: str | None, processed: ProcessedRequest) -> str:
        request_id = str(next(self._ids)) if request_id is None else request_id
        if self.output_processor.in_use(request_id) or request_id in self._beams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_priority(processed.priority)
        params = processed.params
        if isinstance(params, BeamSearchParams):
            self._start_beam_search(request_id, processed, params)
            return request_id
        if isinstance(params, PoolingParams):
            self.output_processor.add_pooling(request_id, processed.prompt_token_ids)
            self.engine_core.add_request(
                EngineCoreRequest(
                    request_id,
                    processed.prompt_token_ids,
                    _POOLING_SAMPLING,
                    0,
                    cache_salt=processed.cache_salt,
                    pooling_params=params,
                    priority=processed.priority,
                )
            )
            return request_id
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        self.output_processor.add(request_id, processed.prompt, processed.prompt_token_ids, params, child_ids)
        samples = [
            self.core_request(
                child_id,
                processed,
                params if params.seed is None else dataclasses.replace(params, seed=params.seed + i),
            )
            for i, child_id in enumerate(child_ids)
        ]
        # The prompt computed once (prompt logprobs are each sample's own: computed whole, as asked).
        if (
            params.n > 1
            and processed.max_tokens > 0
            and len(processed.prompt_token_ids) > 1
            and params.prompt_logprobs is None
        ):
            prompt = dataclasses.replace(processed, prompt_token_ids=processed.prompt_token_ids[:-1], max_tokens=0)
            # With the samples' constraint, so that its grammar compiles while the prompt does: the
            # samples then join at once and find this request still holding the prompt's blocks.
            held = SamplingParams(temperature=0.0, structured_outputs=params.structured_outputs)
            self.engine_core.add_request(self.core_request(request_id, prompt, held, hold=True))
            self._forks[request_id] = [dataclasses.replace(s, fork_of=request_id) for s in samples]
            return request_id
        for sample in samples:
            self.engine_core.add_request(sample)
        return request_id

    def core_request(
        self,
        request_id: str,
        processed: ProcessedRequest,
        params: SamplingParams,
        hold: bool = False,
        fork_of: str | None = None,
    ) -> EngineCoreRequest:
        return EngineCoreRequest(
            request_id,
            processed.prompt_token_ids,
            params,
            processed.max_tokens,
            self.model_config.eos_token_ids,
            processed.cache_salt,
            hold,
            fork_of,
            mm_features=processed.mm_features,
            lora_request=processed.lora_request,
            priority=processed.priority,
        )

    def check_lora(self, lora_request: LoRARequest) -> None:
        """That LoRA is enabled and the adapter fits the model (read once per id; an id already
        checked with another path is refused: the worker keeps adapters by id)."""
        config = self.model_config.lora
        if config is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r}: this engine serves no adapters (start it with --enable-lora)"
            )
        known = self._adapters.get(lora_request.lora_int_id)
        if known is not None:
            if known[0].lora_path != lora_request.lora_path:
                raise ValueError(
                    f"LoRA id {lora_request.lora_int_id} is already {known[0].lora_path!r}, "
                    f"not {lora_request.lora_path!r}"
                )
            return
        info = read_adapter(lora_request.lora_path)
        check_adapter(info, self.model_config.hf_config, config.max_lora_rank)
        self._adapters[lora_request.lora_int_id] = (lora_request, info)

    def _start_beam_search(self, request_id: str, processed: ProcessedRequest, params: BeamSearchParams) -> None:
        driver = BeamSearchDriver(
            request_id,
            processed.prompt,
            processed.prompt_token_ids,
            params,
            processed.max_tokens,
            self.model_config.eos_token_ids,
            processed.cache_salt,
            processed.priority,
        )
        self._beams[request_id] = driver
        self._add_beams(request_id, driver.start())

    def _add_beams(self, request_id: str, beams: list[EngineCoreRequest]) -> None:
        for beam in beams:
            self._beam_of[beam.request_id] = request_id
            self.engine_core.add_request(beam)

    def _release_beams(self, beam_ids: list[str]) -> None:
        for beam_id in beam_ids:
            del self._beam_of[beam_id]
        self.engine_core.finish_requests(beam_ids)

    def _advance_beams(self, request_ids: set[str]) -> list[RequestOutput]:
        """Advance the beam searches whose live beams have all come (their new beams added, the
        parents released); the outputs of those that are done."""
        done = []
        for request_id in request_ids:
            driver = self._beams[request_id]
            if not driver.ready:
                continue
            if driver.error is not None:
                self._release_beams(driver.release())
            else:
                new, released = driver.advance()
                self._add_beams(request_id, new)  # forked from their parents, which are still held
                self._release_beams(released)
            if driver.finished:
                del self._beams[request_id]
                decode = self.tokenizer.decode
                done.append(driver.output(lambda ids: str(decode(ids, skip_special_tokens=True))))
        return done

    def _tokenize(self, prompt: str | list[int], pooling: PoolingParams | None = None) -> tuple[str | None, list[int]]:
        """The prompt's ids, checked. A prompt to generate from leaves a token of room; one to embed
        may fill max_model_len, and is cut to its last truncate_prompt_tokens (-1: max_model_len)."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids, text = list(prompt), None
        else:
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        # Also for text: a tokenizer may know more tokens than the model has embeddings for.
        bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary (size {self.model_config.vocab_size}): {bad[:5]}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        if pooling is None:
            if len(token_ids) >= self.max_model_len:
                raise ValueError(
                    f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                    "which leaves no room to generate"
                )
            return text, token_ids
        truncate = pooling.truncate_prompt_tokens
        if truncate is not None:
            if truncate > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens {truncate} exceeds max_model_len ({self.max_model_len})")
            token_ids = token_ids[-(self.max_model_len if truncate == -1 else truncate) :]
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the input has {len(token_ids)} tokens; this model takes at most {self.max_model_len} "
                "(truncate_prompt_tokens cuts it)"
            )
        return text, token_ids

    def abort_request(self, request_id: str) -> None:
        driver = self._beams.pop(request_id, None)
        if driver is not None:
            self._release_beams(driver.release())
            return
        # The request itself (the held prompt of parallel samples, if any) and its samples.
        self._forks.pop(request_id, None)
        self.engine_core.finish_requests([request_id, *self.output_processor.child_ids(request_id)])
        self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults, as vLLM applies them."""
        gen = self.model_config.generation_defaults
        fields = {
            "temperature": "temperature",
            "top_p": "top_p",
            "top_k": "top_k",
            "min_p": "min_p",
            "repetition_penalty": "repetition_penalty",
            "max_new_tokens": "max_tokens",
        }
        return SamplingParams(**{ours: gen[theirs] for theirs, ours in fields.items() if gen.get(theirs) is not None})

    # -- the loop ------------------------------------------------------------------------------
    def run(
        self,
        on_outputs: Callable[[list[RequestOutput | EmbeddingRequestOutput]], None],
        between_steps: Callable[[bool], bool] | None = None,
    ) -> None:
        """The engine loop every frontend drives (the offline LLM; AsyncLLM's engine thread, for
        the server): step while there are requests, handing each step's outputs to `on_outputs`.
        `between_steps(idle)` runs before each step: it may add and abort requests (and wait for
        some where the engine is idle) and says whether to go on. Without it the loop ends once no
        request is left."""
        while True:
            if between_steps is not None and not between_steps(not self.has_unfinished_requests()):
                return
            if self.has_unfinished_requests():
                on_outputs(self.step())
            elif between_steps is None:
                return
            else:
                self.refresh_stats()

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """One step of the core, its outputs turned into RequestOutputs. A request the core failed
        ends with all of its samples (finish reason "error", the reason in RequestOutput.error)."""
        beams: set[str] = set()  # the beam searches whose beams gave outputs
        core_outputs = [o for o in self.engine_core.step() if not self._to_frontend(o, beams)]
        failed = [self._fail(o.request_id, o.error) for o in core_outputs if o.error is not None]
        outputs, stopped = self.output_processor.process([o for o in core_outputs if o.error is None])
        self.engine_core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs + [o for o in failed if o is not None] + self._advance_beams(beams)

    def _to_frontend(self, output: EngineCoreOutput, beams: set[str]) -> bool:
        """Take an output meant for the frontend itself (a beam's, whose search is noted in
        `beams`; a held prompt that is computed: its samples fork now); False for one the output
        processor turns into text."""
        beam_search = self._beam_of.get(output.request_id)
        if beam_search is not None:
            self._beams[beam_search].take(output)
            beams.add(beam_search)
            return True
        samples = self._forks.get(output.request_id)
        if samples is None or output.error is not None:
            return False  # (a held prompt's failure fails its request, below)
        if output.finish_reason is not None:
            del self._forks[output.request_id]
            self.output_processor.parents[output.request_id].queue_time = output.queue_time
            for sample in samples:
                self.engine_core.add_request(sample)
            self.engine_core.finish_requests([output.request_id])  # released: the samples hold its blocks
        return True

    def _fail(self, core_id: str, error: str) -> RequestOutput | EmbeddingRequestOutput | None:
        parent_id = self.output_processor.parent_of.get(core_id, core_id)
        self._forks.pop(parent_id, None)
        self.engine_core.finish_requests([parent_id, *self.output_processor.child_ids(parent_id)])
        return self.output_processor.fail(parent_id, error)

    def stats(self) -> SchedulerStats:
        """The engine's, its replicas' together (data parallelism)."""
        return self.engine_core.stats()

    def refresh_stats(self) -> None:
        """An idle engine's: take what a core in a process of its own has sent since its last step
        (the stats after releases and aborts; outputs only for requests already ended)."""
        self.engine_core.refresh()

    def request_snapshot(self) -> None:
        """Ask each engine core for its snapshot (the dashboard's): at once where the core runs in
        this thread, else with its next step (an idle core answers within refresh_stats' poll)."""
        self.engine_core.request_snapshot()

    def take_snapshots(self) -> list[EngineSnapshot] | None:
        """Each replica's snapshot asked for, once all have come (else None)."""
        return self.engine_core.take_snapshots()

    def replica_stats(self) -> list[SchedulerStats]:
        """Each engine replica's (one without data parallelism)."""
        return self.engine_core.replica_stats()
