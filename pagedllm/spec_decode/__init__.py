"""Speculative decoding: proposers of draft tokens, which the model runner verifies in one step.

Two methods, as vLLM's speculative_config names them: "ngram" (prompt lookup, in the engine core:
ngram.py) and "draft_model" (a smaller model with the same vocabulary, in the worker beside the
target: worker/draft_runner.py)."""

from __future__ import annotations

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.ngram import NgramProposer


def speculative_proposer(spec: SpeculativeConfig | None) -> NgramProposer | None:
    """The engine core's proposer: n-gram lookup; None without speculation or where the worker's
    draft model proposes."""
    if spec is None or spec.method != "ngram":
        return None
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
