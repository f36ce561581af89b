"""Speculative decoding: proposers of draft tokens, which the model runner verifies in one step."""
from __future__ import annotations

from pagedllm.spec_decode.ngram import NgramProposer

METHODS = ("ngram",)


def speculative_proposer(config: dict | None) -> NgramProposer | None:
    """The proposer vLLM's speculative_config asks for (None: no speculation); raises ValueError
    on a config it cannot serve, so that a bad flag stops the start, never a step."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config is a dict (JSON object), got {type(config).__name__}")
    config = dict(config)
    if "model" in config and config.get("method", "draft_model") != "ngram":
        raise ValueError("speculative_config: draft-model speculation (a 'model') is not supported yet; "
                         "use {\"method\": \"ngram\", ...}")
    method = config.pop("method", None)
    if method not in METHODS:
        raise ValueError(f"speculative_config: unknown method {method!r}; supported: {', '.join(METHODS)}")
    k = config.pop("num_speculative_tokens", None)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
    max_n = config.pop("prompt_lookup_max", 4)
    min_n = config.pop("prompt_lookup_min", min(2, max_n) if isinstance(max_n, int) else 2)
    if config:
        raise ValueError(f"speculative_config: unknown keys {sorted(config)}")
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (min_n, max_n)):
        raise ValueError("speculative_config: prompt_lookup_min and prompt_lookup_max are integers")
    return NgramProposer(k, min_n, max_n)
