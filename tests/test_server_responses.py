"""OpenAI's Responses API through the official `openai` client against a real server: input as text
and items, instructions, reasoning and function-call items, text.format, previous_response_id over
stored responses (get, delete), and the stream's events in order (responses.stream)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from pagedllm import LLM, SamplingParams
from server_utils import Server
from test_server_structured import FORCED_CALL, TEMPLATE

ASK = "What is the weather like in Paris?"
THINKING = r"<think>\nhm+ [a-z]{2,6}\n</think>\n\n[A-Z][a-z]{1,5}\."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}


@pytest.fixture(scope="module")
def client(llama_dir):
    server = Server(
        llama_dir,
        "--max-model-len", "512", "--kv-cache-memory", "32MiB", "--dtype", "float32", "--served-model-name", "tiny",
        "--chat-template", TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3",
    )  # fmt: skip
    yield OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    server.stop()


def test_text_equals_the_offline_chat_and_chains_by_previous_response(client, llama_dir):
    first = client.responses.create(
        model="tiny", input=ASK, instructions="Be brief.", max_output_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    with open(TEMPLATE) as f:
        template = f.read()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}]
    offline = llm.chat(conversation, params, chat_template=template)[0]
    assert first.object == "response" and first.status == "incomplete"
    assert first.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in first.output] == ["message"]
    assert first.output_text == offline.outputs[0].text
    assert first.usage.input_tokens == len(offline.prompt_token_ids) and first.usage.output_tokens == 8
    assert client.responses.retrieve(first.id).output_text == first.output_text
    # The next turn sees the first's input and output (not its instructions).
    second = client.responses.create(
        model="tiny", input="And Rome?", previous_response_id=first.id, max_output_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    history = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And Rome?"},
    ]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert second.output_text == llm.chat(history, params, chat_template=template)[0].outputs[0].text
    # The same conversation given as items.
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "And Rome?"},
    ]
    again = client.responses.create(
        model="tiny", input=items, max_output_tokens=6, temperature=0, store=False, extra_body={"ignore_eos": True}
    )
    assert again.output_text == second.output_text
    with pytest.raises(NotFoundError):
        client.responses.retrieve(again.id)  # store=False
    assert client.responses.delete(first.id) is None
    with pytest.raises(NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(BadRequestError) as info:
        client.responses.create(model="tiny", input="x", previous_response_id=first.id)
    assert info.value.body["param"] == "previous_response_id"


def test_reasoning_and_function_call_items_and_their_round_trip(client):
    thought = client.responses.create(
        model="tiny", input=ASK, max_output_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"regex": THINKING}},
    )  # fmt: skip
    assert [i.type for i in thought.output] == ["reasoning", "message"] and thought.status == "completed"
    assert re.fullmatch(r"hm+ [a-z]{2,6}", thought.output[0].content[0].text)
    assert thought.usage.output_tokens_details.reasoning_tokens > 0
    called = client.responses.create(
        model="tiny", input=ASK, tools=[WEATHER], max_output_tokens=120, temperature=0,
        extra_body={"structured_outputs": {"regex": FORCED_CALL}},
    )  # fmt: skip
    assert [i.type for i in called.output] == ["message", "function_call"]
    call = called.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments)["unit"] == "celsius" and call.call_id
    follow = [
        {"role": "user", "content": ASK},
        *(item.model_dump(exclude_none=True) for item in called.output),
        {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees"},
    ]
    reply = client.responses.create(model="tiny", input=follow, tools=[WEATHER], max_output_tokens=4, temperature=0)
    assert reply.status in ("completed", "incomplete")
    forced = client.responses.create(
        model="tiny", input=ASK, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=120,
    )  # fmt: skip
    assert [i.type for i in forced.output] == ["function_call"] and forced.output[0].name == "get_weather"


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    result = client.responses.create(
        model="tiny", input=ASK, max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
        extra_body={"structured_outputs": None},
    )  # fmt: skip
    if result.status == "completed":
        jsonschema.validate(json.loads(result.output_text), schema)
    else:  # (the tiny model may spend its tokens on the whitespace JSON allows: the schema's prefix)
        assert re.fullmatch(r'\{\s*"city"\s*:\s*"(Paris|Rome)"\s*', result.output_text)


@pytest.mark.parametrize("kind", ["text", "reasoning", "call"])
def test_the_stream_is_the_responses_events_and_builds_the_same_response(client, kind):
    sentence = r"[A-Z][a-z]{1,5} [a-z]{2,6}\."
    extra = {"text": {"structured_outputs": {"regex": sentence}},
             "reasoning": {"structured_outputs": {"regex": THINKING}},
             "call": {"structured_outputs": {"regex": FORCED_CALL}}}[kind]  # fmt: skip
    request = dict(model="tiny", input=ASK, tools=[WEATHER], max_output_tokens=120, temperature=0, extra_body=extra)
    whole = client.responses.create(**request)
    names = []
    with client.responses.stream(**request) as stream:
        for event in stream:
            names.append(event.type)
        final = stream.get_final_response()
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed" and whole.status == "completed"
    assert [i.type for i in final.output] == [i.type for i in whole.output]
    assert final.output_text == whole.output_text
    for ours, theirs in zip(final.output, whole.output):
        if ours.type == "function_call":
            assert (ours.name, ours.arguments) == (theirs.name, theirs.arguments)
        if ours.type == "reasoning":
            assert ours.content[0].text == theirs.content[0].text
    if kind == "text":
        assert "response.output_text.delta" in names and "response.content_part.done" in names
    if kind == "reasoning":
        assert "response.reasoning_text.delta" in names
    if kind == "call":
        assert "response.function_call_arguments.delta" in names
        assert "response.function_call_arguments.done" in names
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client):
    events = list(client.responses.create(model="tiny", input=ASK, max_output_tokens=5, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.usage.output_tokens == 5
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output[0].content[0].text


def test_unsupported_fields_are_refused_by_name(client):
    for extra, name in [
        ({"background": True}, "background"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"text": {"verbosity": "high"}}, "text"),
        ({"conversation": "conv_1"}, "conversation"),
    ]:
        with pytest.raises(BadRequestError) as info:
            client.responses.create(model="tiny", input="x", max_output_tokens=2, extra_body=extra)
        assert info.value.body["param"].startswith(name), (extra, info.value.body)
    ok = client.responses.create(
        model="tiny", input="x", max_output_tokens=2, include=["reasoning.encrypted_content"], store=False,
        reasoning={"effort": "low", "summary": "auto"}, truncation="disabled", service_tier="auto",
    )  # fmt: skip
    assert ok.status in ("completed", "incomplete")
