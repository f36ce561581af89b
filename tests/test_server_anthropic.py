"""Anthropic's Messages API through the official `anthropic` client against a real server: text,
thinking and tool_use blocks, in full and streamed (Anthropic's events in order), stop reasons,
count_tokens, x-api-key, and errors in Anthropic's shape."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import pytest

from pagedllm import LLM, SamplingParams
from server_utils import Server
from test_server_structured import FORCED_CALL, TEMPLATE

KEY = "anthropic-key"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
GREEDY = {"temperature": 0}  # (the client no longer takes sampling knobs; the server still does)
THINKING = r"<think>\nhm+ [a-z]{2,6}\n</think>\n\n[A-Z][a-z]{1,5}\."


@pytest.fixture(scope="module")
def server(llama_dir):
    server = Server(
        llama_dir,
        "--max-model-len", "512", "--kv-cache-memory", "32MiB", "--dtype", "float32", "--served-model-name", "tiny",
        "--chat-template", TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3",
        api_key=KEY,
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_text_equals_the_offline_chat_and_counts_its_tokens(client, llama_dir):
    system = "You answer briefly."
    message = client.messages.create(
        model="tiny", max_tokens=12, system=system, messages=ASK, extra_body={"ignore_eos": True, "temperature": 0}
    )
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    with open(TEMPLATE) as f:
        template = f.read()
    conversation = [{"role": "system", "content": system}, *ASK]
    offline = llm.chat(
        conversation, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), chat_template=template
    )[0]
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == offline.outputs[0].text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.input_tokens == len(offline.prompt_token_ids) and message.usage.output_tokens == 12
    counted = client.messages.count_tokens(model="tiny", system=system, messages=ASK)
    assert counted.input_tokens == message.usage.input_tokens
    # A stop sequence from the text: cut there, and named.
    words = re.findall(r"[A-Za-z]{3,}", message.content[0].text)
    stop = words[-1]
    stopped = client.messages.create(
        model="tiny", max_tokens=12, system=system, messages=ASK, stop_sequences=[stop], extra_body=GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stop not in stopped.content[0].text if stopped.content else True


def test_the_stream_is_anthropics_events_and_builds_the_same_message(client):
    request = dict(model="tiny", max_tokens=10, messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**request)
    names = []
    with client.messages.stream(**request) as stream:
        for item in stream:
            names.append(item.type)
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    raw = [e.type for e in client.messages.create(**request, stream=True)]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert raw[1] == "content_block_start" and raw[-3] == "content_block_stop"
    assert set(raw[2:-3]) == {"content_block_delta"}


def test_thinking_and_tool_use_blocks_in_full_and_streamed(client):
    thought = dict(
        model="tiny", max_tokens=60, messages=ASK, extra_body={**GREEDY, "structured_outputs": {"regex": THINKING}}
    )
    message = client.messages.create(**thought)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert re.fullmatch(r"hm+ [a-z]{2,6}", message.content[0].thinking)
    with client.messages.stream(**thought) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in final.content] == [
        (b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in message.content
    ]
    call = dict(model="tiny", max_tokens=120, messages=ASK, tools=[WEATHER],
                extra_body={**GREEDY, "structured_outputs": {"regex": FORCED_CALL}})  # fmt: skip
    message = client.messages.create(**call)
    assert [b.type for b in message.content] == ["text", "tool_use"] and message.stop_reason == "tool_use"
    use = message.content[1]
    assert use.name == "get_weather" and use.input["unit"] == "celsius" and use.id
    with client.messages.stream(**call) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[1].input == use.input and streamed.stop_reason == "tool_use"
    # The assistant's blocks go back as they came, with the tool's result.
    follow = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22 degrees"}]},
    ]
    reply = client.messages.create(model="tiny", max_tokens=4, messages=follow, tools=[WEATHER], extra_body=GREEDY)
    assert reply.stop_reason in ("max_tokens", "end_turn", "tool_use")
    forced = client.messages.create(
        model="tiny", max_tokens=120, messages=ASK, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
    )
    assert [b.type for b in forced.content] == ["tool_use"] and forced.content[0].input["city"] in ("Paris", "Rome")


def test_errors_come_in_anthropics_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=4, messages=ASK, extra_body={"foo": 1})
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    assert "foo" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="tiny", max_tokens=0, messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="tool_result"):
        bad = [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "y"}]}]
        client.messages.create(model="tiny", max_tokens=4, messages=bad)
    with pytest.raises(anthropic.BadRequestError, match="takes no images"):
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-nonesuch", max_tokens=4, messages=ASK)
    assert info.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model="tiny", max_tokens=4, messages=ASK)
    assert info.value.body["error"]["type"] == "authentication_error"
    # A raw request: the same body with a bearer key works too, and the server goes on.
    body = {"model": "tiny", "max_tokens": 2, "messages": ASK}
    response = httpx.post(f"{server.url}/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200 and json.loads(response.text)["type"] == "message"


def test_output_config_format_and_omitted_thinking(client):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    message = client.messages.create(
        model="tiny",
        max_tokens=200,
        messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    text = message.content[0].text
    if message.stop_reason == "end_turn":
        jsonschema.validate(json.loads(text), schema)
    else:  # (the tiny model may spend its tokens on the whitespace JSON allows: the schema's prefix)
        assert message.stop_reason == "max_tokens" and re.fullmatch(r'\{\s*"city"\s*:\s*"(Paris|Rome)"\s*', text)
    with pytest.raises(anthropic.BadRequestError, match="effort"):
        client.messages.create(model="tiny", max_tokens=4, messages=ASK, output_config={"effort": "high"})
    with pytest.raises(anthropic.BadRequestError, match="container"):
        client.messages.create(model="tiny", max_tokens=4, messages=ASK, container="c1")
    omitted = client.messages.create(
        model="tiny",
        max_tokens=60,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
        extra_body={**GREEDY, "structured_outputs": {"regex": THINKING}},
    )
    assert [(b.type, getattr(b, "thinking", None)) for b in omitted.content][0] == ("thinking", "")
