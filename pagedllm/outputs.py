"""What the engine returns: RequestOutput with one CompletionOutput per sample, and an embedding
request's EmbeddingRequestOutput (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # why the request failed (finish reason "error"), if it did


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated, as vLLM gives them
    text: str  # the generated text
    cum_logprob: float
    score: float  # cum_logprob / generated_length ** length_penalty (EOS not counted)
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """An embedding request's result: one vector for its prompt (LLM.embed, the server's /v1/embeddings)."""

    request_id: str
    outputs: EmbeddingOutput | None  # None only when the request failed
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """A pair's score (LLM.score, /score, /rerank): a cross-encoder's relevance, or the cosine of
    the two texts' embeddings."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """A prompt's label probabilities (LLM.classify, /classify)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
