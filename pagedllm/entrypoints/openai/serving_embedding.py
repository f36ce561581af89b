"""POST /v1/embeddings: OpenAI's embeddings, each input one embedding request through the engine."""

from __future__ import annotations

import base64

import numpy as np
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.protocol import APIError, EmbeddingRequest
from pagedllm.entrypoints.openai.serving import OpenAIServing, new_id, off_loop
from pagedllm.pooling_params import PoolingParams

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, request: EmbeddingRequest) -> JSONResponse:
        if self.check_model(request.model) is not None:
            raise APIError("LoRA adapters serve text generation, not embeddings", param="model")
        self.check_task("embed")
        self.check_priority(request.priority)
        inputs = _input_list(request.input)
        params = PoolingParams(
            dimensions=request.dimensions,
            normalize=request.normalize,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
        )
        try:
            self.engine.check_params(params)
        except ValueError as exc:
            raise APIError(str(exc), param="dimensions") from exc
        processed = []
        for item in inputs:
            try:
                processed.append(await off_loop(self.engine.process_inputs, item, params))
                processed[-1].priority = request.priority
            except ValueError as exc:
                raise APIError(str(exc), param="input") from exc
        request_id = new_id("embd")
        outputs = await self.collect_pooled(self.start(request_id, processed))
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(o.outputs.embedding, request.encoding_format)}
            for i, o in enumerate(outputs)
        ]
        tokens = sum(len(p.prompt_token_ids) for p in processed)
        return JSONResponse(
            {
                "id": request_id,
                "object": "list",
                "created": self.created(),
                "model": self.model_name,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )


def _input_list(value) -> list[str | list[int]]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of those lists."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError("input must not be empty", param="input")
    if all(isinstance(t, int) for t in value):
        return [value]
    if len(value) > MAX_INPUTS:
        raise APIError(f"input holds {len(value)} items; at most {MAX_INPUTS} go in one request", param="input")
    return list(value)


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: its little-endian float32 bytes, as OpenAI sends them (its client asks
    for base64 by default and decodes them)."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
