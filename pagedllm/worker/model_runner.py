"""ModelRunner: a SchedulerOutput -> batch tensors -> forward -> sampled tokens and logprobs."""
from __future__ import annotations

import torch

from pagedllm.config import head_dim
from pagedllm.core.step import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.sampler import Sampler, token_logprobs
from pagedllm.models.loader import ModelConfig


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int) -> int:
    hf = config.hf_config
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim(hf) * config.dtype.itemsize
    return per_token * block_size


class ModelRunner:
    def __init__(self, model_config: ModelConfig, model: torch.nn.Module, num_blocks: int,
                 block_size: int, device: str) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        hf = model_config.hf_config
        shape = (num_blocks, block_size, hf.num_key_value_heads, head_dim(hf))
        self.kv_caches = [(torch.zeros(shape, dtype=model_config.dtype, device=self.device),
                           torch.zeros(shape, dtype=model_config.dtype, device=self.device))
                          for _ in range(hf.num_hidden_layers)]
        self.sampler = Sampler()
        if self.device.type == "cpu":
            cpu_ops()  # build (or load) the kernels now, not inside the first request's time

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self._copy_blocks(output.blocks_to_copy)
        input_ids, positions, meta = self._prepare(output.scheduled)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        result = ModelRunnerOutput()
        self._sample(hidden, output, meta, result)
        self._prompt_logprobs(hidden, output.scheduled, meta, result)
        return result

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _prepare(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        if any(r.num_spec_tokens for r in scheduled):  # the scheduler can; verifying comes with a proposer
            raise NotImplementedError("this runner samples one token a request: it cannot verify draft tokens yet")
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.block_size
        for r in scheduled:
            tokens += r.new_token_ids
            span = range(r.start_pos, r.start_pos + len(r.new_token_ids))
            positions += span
            slots += [r.block_ids[p // bs] * bs + p % bs for p in span]
        query_lens = [len(r.new_token_ids) for r in scheduled]
        seq_lens = [r.start_pos + n for r, n in zip(scheduled, query_lens)]
        width = max(len(r.block_ids) for r in scheduled)
        tables = [r.block_ids + [0] * (width - len(r.block_ids)) for r in scheduled]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.long), block_tables=tensor(tables, torch.int32),
            query_start_loc=tensor(starts, torch.int32), seq_lens=tensor(seq_lens, torch.int32),
            seq_lens_list=seq_lens, query_lens_list=query_lens)
        return tensor(tokens, torch.long), tensor(positions, torch.long), meta

    def _sample(self, hidden: torch.Tensor, output: SchedulerOutput, meta: AttentionMetadata,
                result: ModelRunnerOutput) -> None:
        scheduled = output.scheduled
        rows = [i for i, r in enumerate(scheduled) if r.sample]
        samplers = [scheduled[i] for i in rows]
        if not rows:
            return
        ends = meta.query_start_loc[1:].long() - 1
        logits = self.model.compute_logits(hidden[ends[rows]])
        sampled = self.sampler(logits, samplers, output.token_bitmask)
        for r, token, logprobs in zip(samplers, sampled.token_ids, sampled.logprobs):
            result.sampled_token_ids[r.request_id] = [token]
            if logprobs is not None:
                result.logprobs[r.request_id] = [logprobs]

    def _prompt_logprobs(self, hidden: torch.Tensor, scheduled: list[ScheduledRequest],
                         meta: AttentionMetadata, result: ModelRunnerOutput) -> None:
        """Hidden state at prompt position p scores prompt token p + 1."""
        for i, r in enumerate(scheduled):
            k = r.sampling_params.prompt_logprobs
            end = min(r.start_pos + len(r.new_token_ids), r.num_prompt_tokens - 1)
            if k is None or r.start_pos >= end:
                continue
            first_row = meta.query_start_loc[i].item()
            rows = hidden[first_row:first_row + end - r.start_pos]
            logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
            targets = r.all_token_ids[r.start_pos + 1:end + 1]
            entries: list[TokenLogprobs] = token_logprobs(logprobs, targets, [k] * len(targets))
            result.prompt_logprobs[r.request_id] = (r.start_pos + 1, entries)
