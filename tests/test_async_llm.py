"""AsyncLLM: streams, aborts, one request's failure, and an engine that dies."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.entrypoints.openai.api_server import build_app

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(llama_dir):
    engine = AsyncLLM(EngineArgs(llama_dir, dtype="float32", kv_cache_memory="16MiB"))
    yield engine
    engine.shutdown()


def test_streams_deltas_and_abort_frees_blocks(engine):
    async def main():
        texts = []
        async for output in engine.generate("Hello", PARAMS, "a"):
            texts.append(output.outputs[0].text)
        stream = engine.add_request(
            "b", engine.process_inputs("Hello", SamplingParams(max_tokens=200, ignore_eos=True))
        )
        async for _ in stream:
            break  # leaving early aborts
        await asyncio.sleep(0.5)
        return texts

    texts = asyncio.run(main())
    assert len(texts) == 6
    assert engine.stats.num_running == 0 and engine.stats.kv_blocks_free == engine.stats.kv_blocks_total


def test_one_bad_request_fails_alone(engine):
    async def main():
        with pytest.raises(ValueError):
            engine.process_inputs("", PARAMS)
        good = engine.generate("Hi", PARAMS, "good")
        dup_first = engine.add_request("dup", engine.process_inputs("Hi", PARAMS))
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("dup", engine.process_inputs("Hi", PARAMS))
        outputs = [o async for o in good]
        rest = [o async for o in dup_first]
        return outputs, rest

    outputs, rest = asyncio.run(main())
    assert outputs[-1].finished and rest[-1].finished


def test_dead_engine_fails_requests_and_health(engine):
    def boom():
        raise RuntimeError("simulated engine crash")

    engine.engine.step = boom

    async def main():
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("Hi", PARAMS, "x"):
                pass
        transport = httpx.ASGITransport(app=build_app(engine, "tiny"))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            health = await client.get("/health")
            completion = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        return health, completion

    health, completion = asyncio.run(main())
    assert engine.is_dead and health.status_code == 503
    assert completion.status_code == 503 and completion.json()["error"]["type"] == "service_unavailable"


def test_chat_without_template_is_a_clear_400_and_prefix_hits_reach_metrics(llama_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    engine = AsyncLLM(EngineArgs(llama_dir, tokenizer=str(tmp_path), dtype="float32", kv_cache_memory="16MiB"))

    async def main():
        transport = httpx.ASGITransport(app=build_app(engine, "tiny"))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            long_prompt = "the same long shared prefix " * 12
            for _ in range(2):
                ok = await client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2})
                assert ok.status_code == 200
            metrics = (await client.get("/metrics")).text
            chat = await client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            )
        return metrics, chat

    try:
        metrics, chat = asyncio.run(main())
    finally:
        engine.shutdown()
    hits = [line for line in metrics.splitlines() if line.startswith("pagedllm:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) > 0
    assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]


def test_a_stream_nobody_reads_leaves_nothing_behind(engine):
    async def main():
        engine.add_request("unread", engine.process_inputs("Hi", PARAMS))  # its client left at once
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not engine.num_streams:
                break

    asyncio.run(main())
    assert not engine.num_streams and engine.stats.num_running == 0
    assert engine.stats.kv_blocks_free == engine.stats.kv_blocks_total


def test_a_model_that_cannot_load_raises_in_the_caller(tmp_path):
    """The engine thread loads the model; its failure still reaches the constructor's caller."""
    with pytest.raises(ValueError, match="does not exist"):
        AsyncLLM(EngineArgs(str(tmp_path / "missing")))


def test_torch_work_stays_in_the_engine_thread(llama_dir, monkeypatch):
    """Loading and stepping run in one thread that is not the caller's: a second thread starting
    OpenMP work would make libgomp throttle the engine's workers."""
    import threading

    from pagedllm.engine import llm_engine

    threads = []
    for name in ("__init__", "step"):
        original = getattr(llm_engine.LLMEngine, name)

        def record(self, *args, _original=original, **kwargs):
            threads.append(threading.get_ident())
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(llm_engine.LLMEngine, name, record)
    engine = AsyncLLM(EngineArgs(llama_dir, dtype="float32", kv_cache_memory="16MiB"))
    try:

        async def main():
            async for _ in engine.generate("Hello", PARAMS, "a"):
                pass

        asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(set(threads)) == 1 and threads[0] != threading.get_ident() and len(threads) > 1


def test_beam_search_runs_in_the_engine_loop_and_an_abort_frees_its_beams(engine):
    """A beam search is one request of the engine loop: its one output holds the beams, best first;
    a client that leaves mid-search releases every beam's blocks."""
    from pagedllm import BeamSearchParams

    async def main():
        params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
        outputs = [o async for o in engine.add_request("beams", engine.process_inputs("Hello there", params))]
        long = BeamSearchParams(beam_width=4, max_tokens=200, ignore_eos=True)
        stream = engine.add_request("left", engine.process_inputs("Hello there", long))
        await asyncio.sleep(0.3)  # a few steps in: beams held, forked and released
        held = engine.stats.kv_blocks_total - engine.stats.kv_blocks_free
        stream.close()
        await asyncio.sleep(0.5)
        return outputs, held

    outputs, held = asyncio.run(main())
    assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].outputs) == 3
    assert all(len(beam.token_ids) == 5 for beam in outputs[0].outputs)
    assert [b.cumulative_logprob for b in outputs[0].outputs] == sorted(
        (b.cumulative_logprob for b in outputs[0].outputs), reverse=True
    )
    assert held > 0
    assert engine.stats.num_running == 0 and engine.stats.kv_blocks_free == engine.stats.kv_blocks_total
