"""Sampler: logits of a batch -> next tokens (+ logprobs), all requests at once on tensors.

Order, as vLLM applies it: logprobs are taken from the raw logits; then the token mask (structured
output), allowed tokens and logit bias, bad words, min_tokens, the request's own logits processors,
penalties; greedy rows take the argmax; the
rest are scaled by temperature, cut by top-k, top-p and min-p, and drawn by inverting their
cumulative distribution at a uniform number, which seeded rows derive from their seed and the
token's index.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.core.messages import TokenLogprobs
from pagedllm.core.step import TokenBitmask
from pagedllm.kernels import cpu_ops
from pagedllm.sampling_params import SamplingType, processor_arity
from pagedllm.worker.input_batch import RequestState


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __call__(
        self, logits: torch.Tensor, requests: list[RequestState], token_bitmask: TokenBitmask | None = None
    ) -> SamplerOutput:
        """Changes `logits` in place (fresh from the model each step: a copy would cost ~2 ms
        a step at batch 200)."""
        raw_logprobs, logits = _processed_logits(logits, requests, token_bitmask)
        tokens = greedy_tokens(logits)
        random_rows = [i for i, r in enumerate(requests) if r.sampling_params.sampling_type != SamplingType.GREEDY]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            picked = [requests[i] for i in random_rows]
            tokens[rows] = sample_random(logits[rows], picked)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, gather_logprobs(raw_logprobs, token_list, requests))

    def probabilities(
        self, logits: torch.Tensor, requests: list[RequestState], token_bitmask: TokenBitmask | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each (random-sampling) row's distribution as its draw would see it, all the processing
        above applied, and the raw logprobs where a request wants logprobs: what rejection
        sampling weighs drafts against. Changes `logits` in place, as __call__."""
        raw_logprobs, logits = _processed_logits(logits, requests, token_bitmask)
        return processed_probs(logits, requests), raw_logprobs


def _processed_logits(
    logits: torch.Tensor, requests: list[RequestState], token_bitmask: TokenBitmask | None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The raw logprobs (where wanted), then the logits with the mask, controls and penalties applied."""
    raw_logprobs = _logprobs_wanted(logits, requests)
    logits = apply_token_bitmask(logits, requests, token_bitmask)
    logits = apply_logit_controls(logits, requests)
    return raw_logprobs, apply_penalties(logits, requests)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax of each row; on the CPU by the C++ kernel (torch's own took 0.7-1.3 ms a step at
    64 x 32000 here, 2-3% of a decode step)."""
    ops = cpu_ops() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if ops is None or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.long)
    ops.argmax_rows(tokens, logits)
    return tokens


def _logprobs_wanted(logits: torch.Tensor, requests: list[RequestState]) -> torch.Tensor | None:
    if all(r.sampling_params.logprobs is None for r in requests):
        return None
    return torch.log_softmax(logits, dim=-1)


def apply_token_bitmask(
    logits: torch.Tensor, requests: list[RequestState], bitmask: TokenBitmask | None
) -> torch.Tensor:
    """Tokens a request's mask row does not allow get -inf (after logprobs are taken, as in vLLM:
    logprobs describe the model, the mask only what may be sampled)."""
    if bitmask is None:
        return logits
    rows = [
        (i, bitmask.rows[r.request_id] + r.spec_position)
        for i, r in enumerate(requests)
        if r.request_id in bitmask.rows
    ]
    if not rows:
        return logits
    words = np.ascontiguousarray(np.asarray(bitmask.words, dtype=np.int32)[[row for _, row in rows]])
    ops = cpu_ops() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if ops is not None and logits.is_contiguous():
        # The C++ kernel skips the mask's all-allowed words and fills all-barred ones whole: 16 rows
        # of 49k tokens 0.06-0.2 ms a step (grammar-like masks), against 0.7-0.9 ms row by row below.
        ops.apply_token_mask(logits, torch.tensor([i for i, _ in rows]), torch.from_numpy(words))
        return logits
    # Little-endian words: byte t // 8 of a row holds token t at bit t % 8. Row by row in place:
    # gathering the rows and scattering them back took twice the time.
    blocked = np.unpackbits(~words.view(np.uint8), axis=1, bitorder="little").view(bool)
    blocked = torch.from_numpy(blocked[:, : logits.shape[1]]).to(logits.device)
    for j, (i, _) in enumerate(rows):
        logits[i].masked_fill_(blocked[j], float("-inf"))
    return logits


def apply_logit_controls(logits: torch.Tensor, requests: list[RequestState]) -> torch.Tensor:
    """allowed_token_ids, logit_bias, bad words, min_tokens (stop tokens barred until enough are
    out) and the request's logits processors. At a draft position (speculation) the drafts before
    it count as output: that state's own all_token_ids holds them."""
    for i, r in enumerate(requests):
        params = r.sampling_params
        if params.allowed_token_ids is not None:
            keep = torch.full_like(logits[i], float("-inf"))
            keep[params.allowed_token_ids] = 0.0
            logits[i] += keep
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device)
        if params.bad_words_token_ids:
            barred_words = bad_word_tokens(params.bad_words_token_ids, r.all_token_ids[r.num_prompt_tokens :])
            if barred_words:
                logits[i, barred_words] = float("-inf")
        if r.num_output_tokens < params.min_tokens:
            barred = set(params.stop_token_ids) | (set() if params.ignore_eos else set(r.eos_token_ids))
            if barred:
                logits[i, list(barred)] = float("-inf")
        if params.logits_processors:
            _run_processors(logits, i, r)
    return logits


def bad_word_tokens(words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens barred next: each word's last token where the output ends with the rest of it
    (a one-token word always). Only the output counts, as in vLLM: a prompt that ends with a word's
    start does not bar its end."""
    barred = []
    for word in words:
        prefix = len(word) - 1
        if prefix == 0 or (prefix <= len(output) and output[len(output) - prefix :] == word[:-1]):
            barred.append(word[-1])
    return barred


def _run_processors(logits: torch.Tensor, i: int, r: RequestState) -> None:
    """Row i through the request's logits processors in turn (V0 vLLM's callables)."""
    prompt, output = r.all_token_ids[: r.num_prompt_tokens], r.all_token_ids[r.num_prompt_tokens :]
    row = logits[i]
    for processor in r.sampling_params.logits_processors or ():
        args = (output, row) if processor_arity(processor) == 2 else (prompt, output, row)
        result = processor(*args)
        if not isinstance(result, torch.Tensor) or result.shape != row.shape:
            raise ValueError(
                f"logits processor {processor!r} returned {type(result).__name__} "
                f"{tuple(getattr(result, 'shape', ()))}, not a tensor of shape {tuple(row.shape)}"
            )
        row = result.to(device=logits.device, dtype=logits.dtype)
    logits[i] = row


def apply_penalties(logits: torch.Tensor, requests: list[RequestState]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens; presence and frequency over output tokens."""
    rows = [i for i, r in enumerate(requests) if _has_penalty(r)]
    if not rows:
        return logits
    vocab = logits.shape[1]
    picked = [requests[i] for i in rows]
    output_counts = _token_counts([r.all_token_ids[r.num_prompt_tokens :] for r in picked], vocab, logits.device)
    prompt_seen = _token_counts([r.all_token_ids[: r.num_prompt_tokens] for r in picked], vocab, logits.device) > 0
    idx = torch.tensor(rows, device=logits.device)
    sub = logits[idx]
    rep = torch.tensor([r.sampling_params.repetition_penalty for r in picked], device=logits.device)[:, None]
    seen = prompt_seen | (output_counts > 0)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([r.sampling_params.frequency_penalty for r in picked], device=logits.device)[:, None]
    pres = torch.tensor([r.sampling_params.presence_penalty for r in picked], device=logits.device)[:, None]
    sub = sub - freq * output_counts - pres * (output_counts > 0)
    logits[idx] = sub
    return logits


def _has_penalty(r: RequestState) -> bool:
    p = r.sampling_params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] counts of each token id; padding goes to an extra bin that is cut off."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def sample_random(logits: torch.Tensor, requests: list[RequestState]) -> torch.Tensor:
    """One draw per row by inverting its cumulative distribution: one uniform number a row (from
    the request's seed when it has one), where an exponential race would draw one per
    vocabulary entry (30 ms a step at 64 x 32000 on this CPU, against about 1 ms)."""
    device = logits.device
    cdf = processed_probs(logits, requests).cumsum_(dim=-1)
    u = torch.rand(len(requests), 1, device=device)
    for i, r in enumerate(requests):
        if r.sampling_params.seed is not None:
            u[i] = seeded_uniform(r.sampling_params.seed, r.num_output_tokens)
    # The first token whose cumulative probability passes u; tokens of probability 0 never do.
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    return tokens.clamp_(max=logits.shape[1] - 1)


def processed_probs(logits: torch.Tensor, requests: list[RequestState]) -> torch.Tensor:
    """Rows' distributions after temperature, top-k, top-p and min-p (random-sampling rows)."""
    temperature = torch.tensor([r.sampling_params.temperature for r in requests], device=logits.device)[:, None]
    return torch.softmax(apply_top_k_top_p_min_p(logits / temperature, requests), dim=-1)


def seeded_uniform(seed: int, index: int, purpose: str = "") -> float:
    """A uniform number in [0, 1) from the whole seed (any size) and the output token's index (and,
    for speculative decoding's other draws at that index, their purpose: "draft", "accept", ...).

    A hash rather than a seeded torch.Generator: that one keeps only the low 32 bits of a seed
    (so -1, 2**63 - 1 and 2**64 - 1 drew the same tokens), overflows past 64 bits, and has state
    that a step retried or a request recomputed after preemption would have to rewind."""
    digest = hashlib.blake2b(f"{seed}:{index}{':' + purpose if purpose else ''}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53  # 53 bits: every double in [0, 1) reachable


def apply_top_k_top_p_min_p(logits: torch.Tensor, requests: list[RequestState]) -> torch.Tensor:
    params = [r.sampling_params for r in requests]
    device = logits.device
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if not any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)[:, None]
    ranks = torch.arange(vocab, device=device)[None, :]
    cut = ranks >= top_k
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(cut, float("-inf")), dim=-1)
    # Drop a token once the tokens ranked above it already reach top_p (the first always stays).
    cut |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    cut[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(cut, float("-inf")))


def gather_logprobs(
    raw: torch.Tensor | None, tokens: list[int], requests: list[RequestState]
) -> list[TokenLogprobs | None]:
    if raw is None:
        return [None] * len(requests)
    return token_logprobs(raw, tokens, [r.sampling_params.logprobs for r in requests])


def token_logprobs(logprobs: torch.Tensor, targets: list[int], ks: list[int | None]) -> list[TokenLogprobs | None]:
    """For each row: the target token's logprob and rank, then the row's top-k tokens."""
    target = torch.tensor(targets, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, target)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    k_max = max((k for k in ks if k), default=0)
    top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
    top_values = top_values.tolist() if k_max else None
    top_ids = top_ids.tolist() if k_max else None
    chosen = chosen[:, 0].tolist()
    out: list[TokenLogprobs | None] = []
    for i, k in enumerate(ks):
        if k is None:
            out.append(None)
            continue
        ids, values = [targets[i]], [chosen[i]]
        if k:
            ids += top_ids[i][:k]
            values += top_values[i][:k]
        out.append(TokenLogprobs(ids, values, [ranks[i]] + list(range(1, k + 1))))
    return out
