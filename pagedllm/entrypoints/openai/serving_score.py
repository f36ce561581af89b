"""/score, /rerank and /classify (vLLM's routes): pairs of texts scored by a cross-encoder (or by the
cosine of an embedding model's vectors), documents ranked by their score against a query, texts'
label probabilities from a sequence-classification model."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.protocol import APIError, ClassificationRequest, RerankRequest, ScoreRequest
from pagedllm.entrypoints.openai.serving import OpenAIServing, new_id, off_loop
from pagedllm.entrypoints.score_utils import cosine, score_pairs
from pagedllm.pooling_params import PoolingParams


class OpenAIServingScore(OpenAIServing):
    async def score(self, request: ScoreRequest) -> JSONResponse:
        try:
            pairs = score_pairs(request.text_1, request.text_2)
        except ValueError as exc:
            raise APIError(str(exc), param="text_2") from exc
        scores, tokens = await self._scores(request, pairs, request.truncate_prompt_tokens)
        data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
        return self._answer("score", request.model, {"data": data, "object": "list"}, tokens)

    async def rerank(self, request: RerankRequest) -> JSONResponse:
        pairs = [(request.query, document) for document in request.documents]
        scores, tokens = await self._scores(request, pairs, request.truncate_prompt_tokens)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: request.top_n or None]
        results = []
        for i in order:
            result: dict = {"index": i, "relevance_score": scores[i]}
            if request.return_documents:
                result["document"] = {"text": request.documents[i]}
            results.append(result)
        return self._answer("rerank", request.model, {"results": results}, tokens)

    async def classify(self, request: ClassificationRequest) -> JSONResponse:
        self._check(request.model, "classify")
        texts = [request.input] if isinstance(request.input, str) else request.input
        params = PoolingParams(task="classify", truncate_prompt_tokens=request.truncate_prompt_tokens)
        processed = [await self._process(self.engine.process_inputs, text, params, param="input") for text in texts]
        outputs = await self.collect_pooled(self._started(processed, request.priority))
        labels = getattr(self.engine.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, output in enumerate(outputs):
            probs = output.outputs.embedding
            best = max(range(len(probs)), key=probs.__getitem__)
            label = labels.get(best, labels.get(str(best), f"LABEL_{best}"))
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
        tokens = sum(len(p.prompt_token_ids) for p in processed)
        return self._answer("classify", request.model, {"data": data, "object": "list"}, tokens)

    async def _scores(
        self, request: ScoreRequest | RerankRequest, pairs: list[tuple[str, str]], truncate: int | None
    ) -> tuple[list[float], int]:
        """Each pair's score and the tokens computed: a cross-encoder's, else the cosine of the two
        texts' embeddings (each distinct text embedded once)."""
        if "score" in self.engine.model_config.supported_tasks:
            self._check(request.model, "score")
            params = PoolingParams(task="score", truncate_prompt_tokens=truncate)
            processed = [await self._process(self.engine.process_pair, a, b, params, param="text_2") for a, b in pairs]
            outputs = await self.collect_pooled(self._started(processed, request.priority))
            return [o.outputs.embedding[0] for o in outputs], sum(len(p.prompt_token_ids) for p in processed)
        self._check(request.model, "embed")
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        params = PoolingParams(truncate_prompt_tokens=truncate)
        processed = [await self._process(self.engine.process_inputs, t, params, param="text_2") for t in texts]
        outputs = await self.collect_pooled(self._started(processed, request.priority))
        vectors = {t: o.outputs.embedding for t, o in zip(texts, outputs)}
        return [cosine(vectors[a], vectors[b]) for a, b in pairs], sum(len(p.prompt_token_ids) for p in processed)

    def _check(self, model: str | None, task: str) -> None:
        if self.check_model(model) is not None:
            raise APIError("LoRA adapters serve text generation, not scores", param="model")
        self.check_task(task)

    async def _process(self, fn, *args, param: str):
        try:
            return await off_loop(fn, *args)
        except ValueError as exc:
            raise APIError(str(exc), param=getattr(exc, "param", param)) from exc

    def _started(self, processed: list, priority: int):
        self.check_priority(priority)
        for item in processed:
            item.priority = priority
        return self.start(new_id("score"), processed)

    def _answer(self, prefix: str, model: str | None, body: dict, tokens: int) -> JSONResponse:
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        head = {"id": new_id(prefix), "created": self.created(), "model": self.model_name}
        return JSONResponse({**head, **body, "usage": usage})
