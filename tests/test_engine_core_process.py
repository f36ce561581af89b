"""The engine core in a process of its own (`engine_core_process`): the same outputs as in the
frontend's thread, its failures reach the frontend, and the server runs on it."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from pagedllm.engine.core_client import EngineCoreDeadError
from server_utils import Server

FAULT = 4242
ENGINE = dict(dtype="float32", kv_cache_memory="32MiB", max_model_len=256)
PROMPTS = ["The capital of France", "1 2 3 4", "Once upon a time there was"]


@pytest.fixture(scope="module")
def engines(llama_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDLLM_FAULT", f"token:{FAULT}")  # the core's process reads it at start
        in_process = LLM(llama_dir, **ENGINE)
        own_process = LLM(llama_dir, engine_core_process=True, **ENGINE)
    yield in_process, own_process
    own_process.engine.shutdown()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, stop=["e"]),
        SamplingParams(
            n=2,
            temperature=1.0,
            seed=5,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(regex="[0-9]{2,4}(ab|cd)"),
        ),
    ],
    ids=["greedy", "n3-seeded", "stop-string", "structured"],
)
def test_same_outputs_in_a_process_of_its_own(engines, params):
    thread, process = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in engines)
    for a, b in zip(thread, process):
        assert [(o.token_ids, o.text, o.finish_reason) for o in a.outputs] == [
            (o.token_ids, o.text, o.finish_reason) for o in b.outputs
        ]
    if params.logprobs:  # close, not equal: the steps' batches can differ (the process runs ahead)
        for a, b in zip(thread[0].outputs[0].logprobs, process[0].outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert [p.logprob for p in a.values()] == pytest.approx([p.logprob for p in b.values()], abs=1e-4)


def test_embeddings_in_a_process_of_its_own(engines):
    thread, process = (llm.embed(PROMPTS, use_tqdm=False) for llm in engines)
    for a, b in zip(thread, process):
        assert a.outputs.embedding == pytest.approx(b.outputs.embedding, abs=1e-5)


def test_beam_search_in_a_process_of_its_own(engines):
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    thread, process = (llm.beam_search([PROMPTS[0]], params)[0] for llm in engines)
    assert [s.tokens for s in thread.sequences] == [s.tokens for s in process.sequences]


def test_a_failing_request_ends_alone(engines):
    _, llm = engines
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    failed, fine = llm.generate([{"prompt_token_ids": [5, FAULT, 6]}, PROMPTS[0]], greedy, use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error" and "injected fault" in failed.error
    assert fine.outputs[0].finish_reason == "length" and fine.error is None


def test_a_core_process_that_dies_is_an_error_not_a_hang(llama_dir):
    llm = LLM(llama_dir, engine_core_process=True, **ENGINE)
    os.kill(llm.engine.engine_core.pid, signal.SIGKILL)
    with pytest.raises(EngineCoreDeadError, match="exited"):  # as the request is sent, or at the step
        llm.engine.add_request(None, PROMPTS[0], SamplingParams(max_tokens=4))
        llm.engine.step()


def test_the_server_on_a_core_process(llama_dir):
    from openai import OpenAI

    server = Server(llama_dir, "--engine-core-process", "--max-model-len", "256", "--kv-cache-memory", "16MiB")
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        done = client.completions.create(model=llama_dir, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert done.usage.completion_tokens == 8 or done.choices[0].finish_reason == "stop"
        stream = client.completions.create(model=llama_dir, prompt=PROMPTS[1], max_tokens=8, temperature=0, stream=True)
        assert (
            "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
            == client.completions.create(model=llama_dir, prompt=PROMPTS[1], max_tokens=8, temperature=0)
            .choices[0]
            .text
        )
        # The dashboard's snapshot comes from the core's process with its next (idle) step.
        (snapshot,) = httpx.get(f"{server.url}/dashboard/state").json()["replicas"]
        assert snapshot["requests"] == [] and snapshot["steps"] and set(snapshot["blocks"]) <= {"f", "c"}
        assert snapshot["blocks"].count("f") + snapshot["blocks"].count("c") == snapshot["stats"]["kv_blocks_free"]
    finally:
        status = server.stop()
    assert status == 0


def test_a_failing_core_process_stops_the_server(llama_dir):
    server = Server(
        llama_dir,
        "--engine-core-process",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        env={"PAGEDLLM_FAULT": "fatal:3"},
    )
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            body = {"prompt": "Hello", "max_tokens": 32, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = [line for line in response.iter_lines() if line]
            assert lines[-1] == "data: [DONE]" and "engine has stopped" in json.loads(lines[-2][6:])["error"]["message"]
        assert server.process.wait(timeout=60) != 0
    finally:
        server.stop()


def test_a_child_that_cannot_start_raises_instead_of_hanging():
    from pagedllm.child_process import ChildStartError, start_child

    with pytest.raises(ChildStartError, match="exited with code 1"):
        start_child("pagedllm.no_such_module")
