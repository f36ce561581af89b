"""DraftRunner: a draft model beside the target, proposing each request's next tokens after a step.

The draft keeps its K/V in cache tensors of its own under the target's block tables (the same
block ids and slots: the scheduler allocates `num_lookahead_tokens` slots past a sampling
request's tokens for the draft's proposals). For each request it remembers how far its K/V holds
the request's real tokens; a proposal first feeds it what it has not seen (the whole prompt for a
request new to it, else the tokens verified since), then one token a pass. A request new to the
worker (or resumed after preemption, or hitting the prefix cache) starts from position 0: the
draft never trusts K/V it did not write for that request.

Greedy requests take the draft's argmax; others draw from the draft's distribution (temperature,
top-k, top-p and min-p applied) and keep it, for the rejection sampling that verifies them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedllm import heap
from pagedllm.config import ModelConfig, head_dim, kv_cache_groups, kv_cache_shape, text_config
from pagedllm.sampling_params import SamplingType
from pagedllm.worker.input_batch import InputBatch, RequestState
from pagedllm.worker.rejection_sampler import draw
from pagedllm.worker.sampler import processed_probs, seeded_uniform


@dataclass
class DraftState:
    computed: int = 0  # positions whose draft K/V holds the request's own tokens
    start: int = 0  # position of the first draft of the last proposal
    tokens: list[int] = field(default_factory=list)  # that proposal's drafts
    probs: list[torch.Tensor] = field(default_factory=list)  # their distributions (random sampling only)


def draft_kv_bytes_per_block(config: ModelConfig, block_size: int) -> int:
    hf = text_config(config.hf_config)
    return (
        2
        * hf.num_hidden_layers
        * hf.num_key_value_heads
        * head_dim(hf)
        * getattr(torch, config.cache_dtype).itemsize
        * block_size
    )


def check_draft(target: ModelConfig, draft: ModelConfig) -> None:
    """Raise ValueError where this draft cannot serve this target (at start-up, never mid-serving)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({draft.vocab_size} tokens, {draft.path}) "
            f"is not the target's ({target.vocab_size} tokens): they must share one tokenizer"
        )
    if not draft.is_causal or "generate" not in draft.supported_tasks:
        raise ValueError(f"speculative_config: the draft model {draft.path} does not generate text")
    if len(kv_cache_groups(target.hf_config).windows) > 1 or kv_cache_groups(target.hf_config).windows[0]:
        raise ValueError(
            "speculative_config: a draft model needs a target whose layers keep all their K/V "
            "(no sliding window): the draft reads the target's block tables"
        )
    if len(kv_cache_groups(draft.hf_config).windows) > 1:
        raise ValueError(
            "speculative_config: the draft model mixes sliding and full attention layers; "
            "a draft's layers must be alike"
        )
    if kv_cache_shape(draft.hf_config).latent:
        raise ValueError(
            f"speculative_config: the draft model {draft.path} caches latent K/V (multi-head latent "
            "attention); a draft's cache must be plain K and V"
        )
    if draft.max_model_len < target.max_model_len:
        raise ValueError(
            f"speculative_config: the draft model's context ({draft.max_model_len} tokens) is shorter "
            f"than max_model_len ({target.max_model_len}); lower --max-model-len"
        )


class DraftRunner:
    def __init__(
        self,
        config: ModelConfig,
        model: torch.nn.Module,
        num_blocks: int,
        input_batch: InputBatch,
        device: torch.device,
    ) -> None:
        self.model, self.device, self.input_batch = model, device, input_batch  # the target's requests and tables
        hf = text_config(config.hf_config)
        shape = (num_blocks, input_batch.block_size, hf.num_key_value_heads, head_dim(hf))
        self.kv_caches = [
            (
                heap.kv_zeros(shape, getattr(torch, config.cache_dtype), device),
                heap.kv_zeros(shape, getattr(torch, config.cache_dtype), device),
            )
            for _ in range(hf.num_hidden_layers)
        ]
        self.states: dict[str, DraftState] = {}
        # The last propose's passes that fed one token a request: their seconds and tokens (what a
        # draft token costs; a catch-up over a prompt is paid once a request, drafting or not).
        self.pass_seconds, self.pass_tokens = 0.0, 0

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def take_probs(self, request_id: str, count: int) -> torch.Tensor | None:
        """The distributions of a request's last proposal's first `count` drafts ([count, vocab]);
        None where they were not kept (greedy) or do not match."""
        state = self.states.get(request_id)
        if state is None or len(state.probs) < count or count == 0:
            return None
        return torch.stack(state.probs[:count])

    @torch.inference_mode()
    def propose(self, requests: list[tuple[RequestState, int]]) -> dict[str, list[int]]:
        """Up to `length` drafts for each (state, length), after the state's tokens so far."""
        drafts: dict[str, list[int]] = {}
        feed: list[tuple[RequestState, int, list[int]]] = []  # (state, first position, tokens)
        for state, _ in requests:
            draft = self.states.setdefault(state.request_id, DraftState())
            tokens = state.all_token_ids
            # Its drafts that came true are K/V it holds; from the first that did not, it computes again.
            held = draft.start + _common_prefix(draft.tokens, tokens[draft.start :])
            draft.computed = min(draft.computed, held) if draft.tokens else draft.computed
            draft.computed = min(draft.computed, len(tokens) - 1)
            draft.start, draft.tokens, draft.probs = len(tokens), [], []
            feed.append((state, draft.computed, tokens[draft.computed :]))
            drafts[state.request_id] = draft.tokens
        lengths = {state.request_id: length for state, length in requests}
        self.pass_seconds, self.pass_tokens = 0.0, 0
        for step in range(max(lengths.values(), default=0)):
            began = time.perf_counter()
            logits = self._forward(feed)
            if all(len(tokens) == 1 for _, _, tokens in feed):
                self.pass_seconds += time.perf_counter() - began
                self.pass_tokens += len(feed)
            for (state, start, tokens), row in zip(feed, logits):
                draft = self.states[state.request_id]
                draft.computed = start + len(tokens)
                token, probs = self._pick(row, state, len(draft.tokens))
                draft.tokens.append(token)
                if probs is not None:
                    draft.probs.append(probs)
            feed = [
                (state, start + len(tokens), [self.states[state.request_id].tokens[-1]])
                for state, start, tokens in feed
                if lengths[state.request_id] > step + 1
            ]
        return drafts

    def _pick(self, logits: torch.Tensor, state: RequestState, j: int) -> tuple[int, torch.Tensor | None]:
        """The draft token at draft position j, and its distribution where rejection sampling
        verifies it (None: verified by equality with the target's own draw)."""
        params = state.sampling_params
        if params.sampling_type == SamplingType.GREEDY:
            return int(logits.argmax()), None
        probs = processed_probs(logits[None], [state])[0]
        if params.seed is not None:
            # A seeded request's tokens are the draws it makes without drafts (batch invariance):
            # the draft draws with the target's own number for that token, so that where the two
            # distributions agree the draws do too, and is accepted only where they are equal.
            return draw(probs, seeded_uniform(params.seed, state.num_output_tokens + j)), None
        return draw(probs, float(torch.rand(()))), probs

    def _forward(self, feed: list[tuple[RequestState, int, list[int]]]) -> torch.Tensor:
        """The draft's logits at each fed run's last token, its K/V written into the runs' slots."""
        input_ids, positions, meta = self.input_batch.prepare_runs(feed)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
