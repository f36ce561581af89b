"""PoolingParams: what an embedding request asks of the pooled hidden states (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """`dimensions`: keep the first n values (Matryoshka models only; the engine checks the model);
    `normalize`: scale to unit length (None: the model's own choice: sentence-transformers
    folders say, decoders yes); `truncate_prompt_tokens`: keep only the prompt's last k tokens
    (-1: as many as the model takes). `task`: "embed" (the pooled vector), "classify" (a
    classifier's label probabilities), "score" (a cross-encoder's relevance of a pair);
    `token_type_start`: where a pair's second text begins (its tokens are BERT's type 1)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str = "embed"
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.truncate_prompt_tokens is not None and (
            not isinstance(self.truncate_prompt_tokens, int)
            or self.truncate_prompt_tokens == 0
            or self.truncate_prompt_tokens < -1
        ):
            raise ValueError(
                f"truncate_prompt_tokens must be -1 or a positive integer, got {self.truncate_prompt_tokens!r}"
            )
        if self.task not in POOLING_TASKS:
            raise ValueError(f"unknown pooling task {self.task!r}; pagedllm pools for {', '.join(POOLING_TASKS)}")
        if self.task != "embed" and (self.dimensions is not None or self.normalize is not None):
            raise ValueError("dimensions and normalize apply to embeddings only")
