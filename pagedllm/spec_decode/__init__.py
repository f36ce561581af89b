"""Speculative decoding: proposers of draft tokens, which the model runner verifies in one step.

Two methods, as vLLM's speculative_config names them: "ngram" (prompt lookup, in the engine core:
ngram.py) and "draft_model" (a smaller model with the same vocabulary, in the worker beside the
target: worker/draft_runner.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagedllm.spec_decode.ngram import NgramProposer

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # one of METHODS
    num_speculative_tokens: int  # the most drafts a step verifies for a request
    prompt_lookup_min: int = 2  # ngram
    prompt_lookup_max: int = 4  # ngram
    model: str | None = None  # draft_model: a path pagedllm loads (Hugging Face folder or GGUF file)
    quantization: str | None = None  # draft_model: as --quantization, for the draft (None: auto)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def describe(self) -> str:
        """One start-up line's worth: the method, its draft and how many tokens a step may verify."""
        source = (
            f"n-gram lookup in the context ({self.prompt_lookup_min}-{self.prompt_lookup_max} tokens)"
            if self.method == "ngram"
            else f"draft model {self.model}"
        )
        return f"{self.method}, up to {self.num_speculative_tokens} draft tokens a step from {source}"


def parse_speculative_config(config: dict | None) -> SpeculativeConfig | None:
    """vLLM's speculative_config dict, checked (None: no speculation). Raises ValueError on one it
    cannot serve, so that a bad flag stops the start, never a step: an unknown method or key,
    num_speculative_tokens < 1, a draft path that does not exist (the draft's vocabulary is checked
    against the target's when the engine loads, still before serving)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config is a dict (JSON object), got {type(config).__name__}")
    config = dict(config)
    method = config.pop("method", "draft_model" if "model" in config else None)
    if method not in METHODS:
        raise ValueError(f"speculative_config: unknown method {method!r}; supported: {', '.join(METHODS)}")
    k = config.pop("num_speculative_tokens", None)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
    if method == "ngram":
        max_n = config.pop("prompt_lookup_max", 4)
        min_n = config.pop("prompt_lookup_min", min(2, max_n) if isinstance(max_n, int) else 2)
        _no_more(config)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (min_n, max_n)):
            raise ValueError("speculative_config: prompt_lookup_min and prompt_lookup_max are integers")
        NgramProposer(k, min_n, max_n)  # checks the range
        return SpeculativeConfig(method, k, min_n, max_n)
    model = config.pop("model", None)
    quantization = config.pop("quantization", None)
    _no_more(config)
    if not isinstance(model, str) or not model:
        raise ValueError("speculative_config: method 'draft_model' needs a 'model' (a path)")
    if not os.path.exists(os.path.expanduser(model)):
        raise ValueError(f"speculative_config: the draft model {model!r} does not exist")
    return SpeculativeConfig(method, k, model=os.path.expanduser(model), quantization=quantization)


def _no_more(config: dict) -> None:
    if config:
        raise ValueError(f"speculative_config: unknown keys {sorted(config)}")


def speculative_proposer(spec: SpeculativeConfig | None) -> NgramProposer | None:
    """The engine core's proposer: n-gram lookup; None without speculation or where the worker's
    draft model proposes."""
    if spec is None or spec.method != "ngram":
        return None
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
