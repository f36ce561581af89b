"""ModelRunner: a SchedulerOutput -> the persistent batch's update -> batch tensors -> forward ->
sampled tokens and logprobs."""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm import heap
from pagedllm.config import KVCacheShape, ModelConfig, kv_cache_groups, kv_cache_shape, text_config
from pagedllm.core.messages import TokenLogprobs
from pagedllm.core.step import KVStoreReport, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.distributed import parallel_state
from pagedllm.distributed.parallel_state import head_share, max_kv_heads_per_rank
from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.pooler import Pooler
from pagedllm.models.interface import MultiModalEmbeds
from pagedllm.sampling_params import SamplingType
from pagedllm.worker.cuda_graph import CudaGraphRunner
from pagedllm.worker.draft_runner import DraftRunner
from pagedllm.worker.input_batch import InputBatch, RequestState
from pagedllm.worker.lora_manager import LoRAManager
from pagedllm.worker.rejection_sampler import rejection_sample
from pagedllm.worker.sampler import Sampler, token_logprobs

if TYPE_CHECKING:  # (LMDB is imported only where the store is opened)
    from pagedllm.worker.kv_store import KVStore

logger = logging.getLogger(__name__)

# Steps of at least this many tokens hand their temporaries' heap pages back afterwards (heap.trim:
# about 1 ms, against a few hundred for such a step on the CPU).
TRIM_AFTER_TOKENS = 512


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, tensor_parallel_size: int = 1) -> int:
    """A rank's bytes; 0 for an encoder, which keeps no KV cache (its blocks are only the scheduler's
    bookkeeping)."""
    if not config.is_causal:
        return 0
    hf = text_config(config.hf_config)
    # A block id is a block of each cache tensor: one a layer, or (several groups) one a layer of a group.
    num_slots, shape = kv_cache_groups(hf).num_slots, kv_cache_shape(hf)
    kv_heads = max_kv_heads_per_rank(shape.heads, tensor_parallel_size)
    per_token = shape.tensors * num_slots * kv_heads * shape.head_dim * getattr(torch, config.cache_dtype).itemsize
    return per_token * block_size


def kv_pair(
    shape: KVCacheShape, blocks: tuple[int, int], dtype: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's (K, V) cache tensors [blocks, block_size, this rank's heads, head_dim]; a latent
    cache's one tensor twice."""
    heads = head_share(shape.heads, shape.heads).kv_count  # (which does not depend on the query heads)
    size = (*blocks, heads, shape.head_dim)
    k = heap.kv_zeros(size, getattr(torch, dtype), device)
    return (k, k) if shape.latent else (k, heap.kv_zeros(size, getattr(torch, dtype), device))


def profile_pass(
    model: torch.nn.Module, config: ModelConfig, num_tokens: int, num_seqs: int, block_size: int, device: torch.device
) -> torch.Tensor:
    """A pass of `num_tokens` tokens (one sequence, over a cache of one block) and the logits of
    `num_seqs` of its rows: what a step's activations peak at, for Worker.device_kv_budget to
    measure. Returns the logits."""
    hf = text_config(config.hf_config)
    groups = kv_cache_groups(hf)
    pairs = [kv_pair(kv_cache_shape(hf), (1, block_size), config.cache_dtype, device) for _ in range(groups.num_slots)]
    slots = torch.arange(num_tokens, device=device) % block_size
    tables = torch.zeros((1, -(-num_tokens // block_size)), dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        seq_lens_list=[num_tokens],
        query_lens_list=[num_tokens],
        group_tables=[(slots, tables)] * (len(groups.windows) - 1),
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device) % config.max_model_len
    with torch.inference_mode():
        hidden = model(ids, positions, [pairs[slot] for slot in groups.layer_slot], meta)
        return model.compute_logits(hidden[-num_seqs:])


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        device: str,
        draft: tuple[ModelConfig, torch.nn.Module] | None = None,
        kv_store: KVStore | None = None,
    ) -> None:
        self.model = model
        self.kv_store = kv_store  # the second tier (--kv-offload-dir), or None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-store-reader") if kv_store is not None else None
        self.device = torch.device(device)
        hf = text_config(model_config.hf_config)
        # One (K, V) pair of tensors a slot; each layer uses its slot's (config.KVCacheGroups: one
        # a layer where all layers are alike; shared by one layer of each group otherwise). An
        # encoder has none. A latent cache (config.KVCacheShape) is one tensor, as K and as V.
        slots = kv_cache_groups(hf).layer_slot if model_config.is_causal else ()
        # With CUDA graphs, one block more: the scratch block their padding rows write and read.
        graphs = model_config.cuda_graph_sizes if model_config.is_causal and model_config.lora is None else ()
        self.kv_slots = [
            kv_pair(kv_cache_shape(hf), (num_blocks + bool(graphs), block_size), model_config.cache_dtype, self.device)
            for _ in range(max(slots, default=-1) + 1)
        ]
        self.kv_caches = [self.kv_slots[slot] for slot in slots]
        self.sampler = Sampler()
        self.pooler = Pooler(model_config.pooler_config)
        self.input_batch = InputBatch(block_size, self.device)
        self.encoder_cache: dict[int, torch.Tensor] = {}  # an image's identifier -> its embeddings
        # Draft-model speculation: the draft beside the target, under the same block tables.
        self.draft = DraftRunner(*draft, num_blocks, self.input_batch, self.device) if draft is not None else None
        self.lora = self._lora_manager(model_config)
        if self.device.type == "cpu":
            cpu_ops()  # build (or load) the kernels now, not inside the first request's time
        self.graphs = self._capture(graphs, model_config, num_blocks, block_size) if graphs else None

    def _capture(
        self, sizes: tuple[int, ...], model_config: ModelConfig, num_blocks: int, block_size: int
    ) -> CudaGraphRunner | None:
        """The decode passes as CUDA graphs; None (every pass eager) where the model's pass cannot
        be captured (a host synchronization in it: a mixture of experts' routing), which the log says."""
        width = -(-model_config.max_model_len // block_size)
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                runner = CudaGraphRunner(self.model, self.kv_caches, sizes, width, num_blocks, block_size, self.device)
        except Exception as exc:  # (torch's capture errors have no common type)
            logger.warning("CUDA graphs: the decode pass could not be captured (%s); running eagerly", exc)
            return None
        logger.info(
            "CUDA graphs: decode passes of %d batch sizes (up to %d) captured in %.1f s",
            len(sizes),
            sizes[-1],
            time.perf_counter() - start,
        )
        return runner

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        if self.kv_store is None:
            return self._execute(output)
        # The store's reads go into blocks no request of this step reads: they run beside its forward
        # pass, on the reader thread (a step of reads alone waits for them).
        reading = self._reader.submit(self._read_blocks, output.kv_loads)
        try:
            result = self._execute(output) if output.scheduled else ModelRunnerOutput()
        finally:
            found = reading.result()
        result.kv_store = self._store_report(output.kv_loads, found)
        self._save_blocks([save for r in output.scheduled for save in r.kv_saves])
        return result

    def _execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        states = self.input_batch.update(output)
        if self.draft is not None:
            for request_id in output.finished_request_ids | output.preempted_request_ids:
                self.draft.forget(request_id)
            for r in output.scheduled:
                if r.new_request is not None:
                    self.draft.forget(r.request_id)
        self._copy_blocks(output.blocks_to_copy)
        input_ids, positions, meta = self.input_batch.prepare(output.scheduled, states)
        meta.token_types = _token_types(states, positions, meta.query_lens_list)
        if self.lora is not None:
            loras = [s.lora_request for s in states]
            # The adapters every held request runs under, which no eviction may drop: only in steps with one.
            live = (
                {s.lora_request.lora_int_id for s in self.input_batch.requests.values() if s.lora_request}
                if any(loras)
                else set()
            )
            self.lora.prepare_step(loras, meta.query_lens_list, live)
        mm = self._images(output, states, meta)
        positions = self._rope_positions(states, positions, meta)
        hidden = None
        if self.graphs is not None and mm is None:  # (no graphs where adapters are enabled)
            hidden = self.graphs.run(input_ids, positions, meta)
        if hidden is None:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, **({"mm": mm} if mm is not None else {}))
        result = ModelRunnerOutput()
        self._pool(hidden, output.scheduled, states, meta, result)
        self._sample(hidden, output, states, meta, result)
        self._prompt_logprobs(hidden, output.scheduled, states, meta, result)
        # Last, once nothing can raise: a failed step appends nothing, so its rerun does not append twice.
        self.input_batch.append_sampled(result.sampled_token_ids)
        if self.draft is not None and output.num_draft_tokens:
            proposing = [
                (state, output.num_draft_tokens.get(r.request_id, 0))
                for r, state in zip(output.scheduled, states)
                if r.request_id in result.sampled_token_ids
            ]
            start = time.perf_counter()
            result.spec_token_ids = self.draft.propose([(state, n) for state, n in proposing if n > 0])
            result.draft_seconds = time.perf_counter() - start
            result.draft_token_cost = (self.draft.pass_seconds, self.draft.pass_tokens)
        if self.device.type == "cpu" and input_ids.shape[0] >= TRIM_AFTER_TOKENS:
            heap.trim()
        return result

    def _block_tensors(self) -> list[torch.Tensor]:
        """The cache tensors a block id indexes, in the store's order: K then V of each slot."""
        return [t for pair in self.kv_slots for t in dict.fromkeys(pair)]  # (a latent slot's one tensor once)

    def _read_blocks(self, loads: list[tuple[int, int]]) -> list[bool]:
        """Read blocks from the store into the cache; whether each was whole (one that is not is
        left unread)."""
        if not loads:
            return []
        tensors = self._block_tensors()
        sizes = [t[0].numel() * t.element_size() for t in tensors]

        def into(i: int, payload: memoryview) -> bool:
            if payload.nbytes != sum(sizes):
                return False  # another layout (the model's digest should have kept it apart)
            src = np.frombuffer(payload, dtype=np.uint8)  # the store's pages, read-only: copied from
            block, offset = loads[i][1], 0
            for tensor, size in zip(tensors, sizes):
                tensor[block].view(torch.uint8).view(-1).numpy()[:] = src[offset : offset + size]
                offset += size
            return True

        return self.kv_store.read([h for h, _ in loads], into)

    def _store_report(self, loads: list[tuple[int, int]], found: list[bool]) -> KVStoreReport:
        """The step's reads and the store's counters. Under tensor parallelism a block any rank
        lacks counts as lacking on all, so that no rank computes from K/V another does not have."""
        if loads and parallel_state.tensor_parallel().size > 1:
            missing = torch.tensor([0.0 if ok else 1.0 for ok in found])
            found = (parallel_state.all_reduce(missing) == 0).tolist()
        report = self.kv_store.take_report()
        report.loaded = [h for (h, _), ok in zip(loads, found) if ok]
        report.failed = [h for (h, _), ok in zip(loads, found) if not ok]
        return report

    def _save_blocks(self, saves: list[tuple[int, int]]) -> None:
        """Copy the step's newly full blocks out of the cache (one gather) and hand them to the
        store's writer: the step does not wait for the disk."""
        if not saves:
            return
        ids = torch.tensor([block for _, block in saves])
        copied = torch.cat([t[ids].view(len(saves), -1).view(torch.uint8) for t in self._block_tensors()], dim=1)
        for (block_hash, _), row in zip(saves, copied):
            self.kv_store.save(block_hash, row.numpy())

    def _lora_manager(self, model_config: ModelConfig) -> LoRAManager | None:
        """Adapter slots in the model's layers, where LoRA is enabled (the C++ stack is built again
        with them)."""
        if model_config.lora is None:
            return None
        manager = LoRAManager(self.model, model_config.lora, getattr(torch, model_config.dtype), self.device)
        self.model.bind_kernels()
        return manager

    def _images(
        self, output: SchedulerOutput, states: list[RequestState], meta: AttentionMetadata
    ) -> MultiModalEmbeds | None:
        """Encode the step's new images into the encoder cache (dropping what the scheduler
        evicted first), and gather the rows of every image the step's tokens reach."""
        for identifier in output.evicted_encoder_ids:
            self.encoder_cache.pop(identifier, None)
        rows: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        starts = None
        for i, (r, state) in enumerate(zip(output.scheduled, states)):
            if not state.mm_features:
                continue
            for index in r.encoder_inputs:
                feature = state.mm_features[index]
                self.encoder_cache[feature.identifier] = self.model.encode_image(feature.data)
            start, end = r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens
            for feature in state.mm_features:
                if not feature.overlaps(start, end):
                    continue
                starts = meta.query_start_loc.tolist() if starts is None else starts
                lo, hi = max(start, feature.offset), min(end, feature.end)
                rows.append(torch.arange(starts[i] + lo - start, starts[i] + hi - start))
                if self.model.bidirectional_images:
                    meta.image_spans.append((i, starts[i] + lo - start, starts[i] + hi - start))
                if feature.identifier not in self.encoder_cache:  # (a failed step's, booked but never run)
                    self.encoder_cache[feature.identifier] = self.model.encode_image(feature.data)
                embeds.append(self.encoder_cache[feature.identifier][lo - feature.offset : hi - feature.offset])
        if not rows:
            return None
        return MultiModalEmbeds(torch.cat(rows).to(self.device), torch.cat(embeds))

    def _rope_positions(
        self, states: list[RequestState], positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """A model with M-RoPE, in a step with a request whose prompt has images: [3, tokens] rows
        of rotary positions, its own from the model for that request's tokens; else `positions`."""
        if not getattr(self.model, "mrope", False) or not any(state.mm_features for state in states):
            return positions
        rows = positions.expand(3, -1).clone()
        first = 0
        for state, num_rows in zip(states, meta.query_lens_list):
            if state.mm_features:
                if state.rope_positions is None:
                    state.rope_positions = self.model.rope_positions(state.mm_features, state.num_prompt_tokens)
                prompt, delta = state.rope_positions.prompt, state.rope_positions.delta
                index = np.arange(state.num_computed_tokens, state.num_computed_tokens + num_rows)
                inside = index < prompt.shape[1]
                block = np.where(inside, prompt[:, np.minimum(index, prompt.shape[1] - 1)], index + delta)
                rows[:, first : first + num_rows] = torch.from_numpy(block)
            first += num_rows
        return rows

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        # The draft's K/V lives under the same block ids: its blocks are copied alike.
        for k_cache, v_cache in self.kv_slots + (self.draft.kv_caches if self.draft is not None else []):
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _sample(
        self,
        hidden: torch.Tensor,
        output: SchedulerOutput,
        states: list[RequestState],
        meta: AttentionMetadata,
        result: ModelRunnerOutput,
    ) -> None:
        """A token for each request that samples. A request with k draft tokens is sampled at its
        last k + 1 positions, each as if the drafts before it were its output (penalties, min_tokens
        and a seeded draw's index see them). Drafts that came as single tokens (n-gram lookup, or a
        greedy request's draft model) are accepted while they equal what was sampled, and the first
        token that differs (or the one after all k) is its own: every token is drawn from the
        target's own distribution with the draw it would have had without drafts (a seeded request's
        draft-model drafts too). Other sampled drafts of a draft model go through rejection sampling
        (_rejection_sample)."""
        exact: list[tuple[ScheduledRequest, RequestState, int]] = []  # (request, state, its last row)
        weighed: list[tuple[ScheduledRequest, RequestState, int, torch.Tensor]] = []  # (.., the drafts' q)
        ends = (meta.query_start_loc[1:] - 1).tolist()
        for i, (r, state) in enumerate(zip(output.scheduled, states)):
            if not r.sample or state.pooling_params is not None:
                continue
            q = self._draft_probs(r, state)
            if q is None:
                exact.append((r, state, ends[i]))
            else:
                weighed.append((r, state, ends[i], q))
        if weighed:
            self._rejection_sample(hidden, weighed, output, result)
        if not exact:
            return
        logits, samplers = self._positions(hidden, exact)
        sampled = self.sampler(logits, samplers, output.token_bitmask)
        first = 0
        for r, _, _ in exact:
            tokens: list[int] = []
            for draft in [*r.spec_token_ids, None]:
                tokens.append(sampled.token_ids[first + len(tokens)])
                if tokens[-1] != draft:
                    break
            result.sampled_token_ids[r.request_id] = tokens
            if sampled.logprobs[first] is not None:
                result.logprobs[r.request_id] = sampled.logprobs[first : first + len(tokens)]
            first += r.num_spec_tokens + 1

    def _positions(self, hidden: torch.Tensor, requests: list[tuple]) -> tuple[torch.Tensor, list[RequestState]]:
        """Logits at each (request, state, last row, ...)'s last k + 1 positions, and the state each
        samples as: the request's own with the drafts before that position appended."""
        rows: list[int] = []
        samplers: list[RequestState] = []
        for r, state, end, *_ in requests:
            drafts = r.spec_token_ids
            for j in range(len(drafts) + 1):
                rows.append(end - len(drafts) + j)
                samplers.append(
                    state
                    if j == 0
                    else dataclasses.replace(state, all_token_ids=state.all_token_ids + drafts[:j], spec_position=j)
                )
        return self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)]), samplers

    def _draft_probs(self, r: ScheduledRequest, state: RequestState) -> torch.Tensor | None:
        """The draft model's distributions of this request's drafts, where they are verified by
        rejection sampling (a random-sampling request without a seed); None: verified by equality
        (greedy, seeded, n-gram)."""
        if self.draft is None or not r.spec_token_ids or state.sampling_params.sampling_type == SamplingType.GREEDY:
            return None
        return self.draft.take_probs(r.request_id, r.num_spec_tokens)

    def _rejection_sample(
        self,
        hidden: torch.Tensor,
        weighed: list[tuple[ScheduledRequest, RequestState, int, torch.Tensor]],
        output: SchedulerOutput,
        result: ModelRunnerOutput,
    ) -> None:
        """Requests whose drafts came with the draft's distributions: each draft accepted with
        probability min(1, p / q), the first rejected one replaced from the residual (layers/
        rejection_sampler.py). (Seeded requests are verified by equality instead.)"""
        logits, samplers = self._positions(hidden, weighed)
        probs, raw = self.sampler.probabilities(logits, samplers, output.token_bitmask)
        at = 0
        for r, state, _, q in weighed:
            k = r.num_spec_tokens
            tokens = rejection_sample(probs[at : at + k + 1], q, r.spec_token_ids, _unseeded_uniform)
            result.sampled_token_ids[r.request_id] = tokens
            wanted = state.sampling_params.logprobs
            if raw is not None and wanted is not None:
                result.logprobs[r.request_id] = token_logprobs(
                    raw[at : at + len(tokens)], tokens, [wanted] * len(tokens)
                )
            at += k + 1

    def _pool(
        self,
        hidden: torch.Tensor,
        scheduled: list[ScheduledRequest],
        states: list[RequestState],
        meta: AttentionMetadata,
        result: ModelRunnerOutput,
    ) -> None:
        """Embedding requests: fold the step's rows into each one's pooling state; the one whose
        prompt this step finished gets its embedding."""
        first_row = 0
        for r, state, num_rows in zip(scheduled, states, meta.query_lens_list):
            if state.pooling_params is not None:
                self.pooler.accumulate(
                    state.pooling, hidden[first_row : first_row + r.num_new_tokens], r.num_computed_tokens
                )
                if r.sample:
                    result.pooler_output[r.request_id] = self.pooler.finish(
                        state.pooling,
                        state.pooling_params,
                        getattr(self.model, "classify", None),
                        getattr(self.model, "score_activation", None),
                    )
            first_row += num_rows

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        scheduled: list[ScheduledRequest],
        states: list[RequestState],
        meta: AttentionMetadata,
        result: ModelRunnerOutput,
    ) -> None:
        """Hidden state at prompt position p scores prompt token p + 1."""
        for i, (r, state) in enumerate(zip(scheduled, states)):
            k = state.sampling_params.prompt_logprobs
            start = r.num_computed_tokens
            end = min(start + r.num_new_tokens, state.num_prompt_tokens - 1)
            if k is None or start >= end:
                continue
            first_row = meta.query_start_loc[i].item()
            rows = hidden[first_row : first_row + end - start]
            logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
            targets = state.all_token_ids[start + 1 : end + 1]
            entries: list[TokenLogprobs] = token_logprobs(logprobs, targets, [k] * len(targets))
            result.prompt_logprobs[r.request_id] = (start + 1, entries)


def _unseeded_uniform(j: int, purpose: str) -> float:
    """Rejection sampling's numbers for requests without a seed (seeded ones never reach it)."""
    return float(torch.rand(()))


def _token_types(states: list[RequestState], positions: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """BERT's token types of the step's rows where a request is a pair of texts (its positions from
    the second text's start are type 1); None where none is."""
    starts = [s.pooling_params.token_type_start if s.pooling_params is not None else None for s in states]
    if all(start is None for start in starts):
        return None
    types = torch.zeros(positions.shape[0], dtype=torch.long, device=positions.device)
    row = 0
    for start, count in zip(starts, rows):
        if start is not None:
            span = slice(row, row + count)
            types[span] = (positions[span] >= start).long()
        row += count
    return types
