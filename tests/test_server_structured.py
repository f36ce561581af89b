"""Structured output, tool calling and reasoning through the official `openai` client against a
real server: constraints hold on every output, tool calls round-trip (in full and streamed), and
the default model fills a Pydantic model for a dozen prompts."""

from __future__ import annotations

import json
import os
import re
from enum import Enum
from typing import Annotated

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from conftest import _DEFAULT_GGUF, default_model_dir
from server_utils import Server

TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "examples", "tool_chat_template_hermes.jinja")
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "[A-Z][a-z]{2,8}"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    server = Server(
        llama_dir,
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "32MiB",
        "--dtype",
        "float32",
        "--served-model-name",
        "tiny",
        "--chat-template",
        TEMPLATE,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        log_path=str(log),
    )
    yield OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    assert server.stop() in (0, -15)


CONSTRAINTS = [  # (request fields, check of one output)
    ({"structured_outputs": {"regex": r"[0-9]{2,3}-[a-z]{2,4}"}}, lambda t: re.fullmatch(r"[0-9]{2,3}-[a-z]{2,4}", t)),
    ({"guided_regex": r"(ab|cd){1,4}!"}, lambda t: re.fullmatch(r"(ab|cd){1,4}!", t)),
    ({"structured_outputs": {"choice": ["left", "right", 'up "high"']}}, lambda t: t in ["left", "right", 'up "high"']),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ["yes", "no"]),
    (
        {"structured_outputs": {"grammar": 'root ::= "[" [0-9] ("," [0-9]){0,3} "]"'}},
        lambda t: re.fullmatch(r"\[[0-9](,[0-9]){0,3}\]", t),
    ),
    ({"guided_grammar": 'root ::= ("x" | "yz"){1,5} "."'}, lambda t: re.fullmatch(r"(x|yz){1,5}\.", t)),
    (
        {"structured_outputs": {"json": SCHEMAS["get_weather"], "disable_any_whitespace": True}},
        lambda t: jsonschema.validate(json.loads(t), SCHEMAS["get_weather"]) is None,
    ),
]


@pytest.mark.parametrize("fields, check", CONSTRAINTS, ids=[str(c[0])[:40] for c in CONSTRAINTS])
def test_constraints_hold_on_every_output(client, fields, check):
    for temperature, n in ((0.0, 1), (1.0, 3)):
        chat = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=60, n=n, seed=1, temperature=temperature, extra_body=fields
        )
        completion = client.completions.create(
            model="tiny", prompt="Answer:", max_tokens=60, n=n, seed=2, temperature=temperature, extra_body=fields
        )
        texts = [c.message.content for c in chat.choices] + [c.text for c in completion.choices]
        reasons = [c.finish_reason for c in chat.choices + completion.choices]
        assert len(texts) == 2 * n and set(reasons) == {"stop"}, (texts, reasons)
        for text in texts:
            assert check(text) is not False and check(text) is not None, text


def test_json_object_response_format_on_completions(client):
    result = client.completions.create(
        model="tiny",
        prompt="JSON:",
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    text = result.choices[0].text
    assert result.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict), text
    assert text.lstrip().startswith("{")


def test_max_tokens_inside_a_constraint_finishes_with_length(client):
    result = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, temperature=0, extra_body={"guided_regex": "[a-z]{20}"}
    )
    assert result.choices[0].finish_reason == "length"


def _assert_valid_calls(calls, names=None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_calls_round_trip(client):
    first = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _assert_valid_calls(choice.message.tool_calls, SCHEMAS)
    messages = (
        MESSAGES
        + [choice.message.model_dump(exclude_none=True)]
        + [
            {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}
            for call in choice.message.tool_calls
        ]
    )
    final = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert isinstance(final.choices[0].message.content, str) or final.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "ping"}}], ids=["required", "named"]
)
def test_a_tool_without_parameters_is_called_with_none(client, tool_choice):
    """OpenAI: a function defined without `parameters` takes none; its arguments are `{}`."""
    ping = {"type": "function", "function": {"name": "ping", "description": "Check that the service answers"}}
    for seed_text in ("Ping it.", "Is the service up? Check twice.", "Hello"):
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": seed_text}],
            tools=[ping],
            tool_choice=tool_choice,
            max_tokens=80,
            temperature=0,
            parallel_tool_calls=False,
        )
        calls = reply.choices[0].message.tool_calls
        assert calls and all(c.function.name == "ping" and json.loads(c.function.arguments) == {} for c in calls)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_streamed_tool_calls_reassemble_into_the_same_calls(client, tool_choice):
    request = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**request).choices[0]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] = call["name"] or (delta.function.name if delta.function else None)
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert reasons[-1] == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert all(c["id"] for c in calls.values())
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in whole.message.tool_calls] == ["get_time"]
        _assert_valid_calls(whole.message.tool_calls)


def test_parallel_tool_calls_false_makes_one_call(client):
    for seed in range(3):
        result = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
        )
        assert len(result.choices[0].message.tool_calls) == 1


FORCED_CALL = (
    r"Let me check\.\n<tool_call>\n"
    r'\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'
)


def test_auto_tool_choice_parses_the_hermes_format(client):
    """The tiny model writes what the regex allows; the server's hermes parser reads the call out."""
    request = dict(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=80,
        temperature=0,
        extra_body={"guided_regex": FORCED_CALL},
    )
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    call = whole.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "celsius"
    content, names, arguments = "", [], ""
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                names += [delta.function.name] if delta.function and delta.function.name else []
                arguments += delta.function.arguments or "" if delta.function else ""
    assert (content, names, arguments) == ("Let me check.", ["get_weather"], call.function.arguments)


def test_reasoning_goes_to_reasoning_content(client):
    request = dict(
        model="tiny",
        messages=MESSAGES,
        max_tokens=80,
        temperature=0,
        extra_body={"guided_regex": r"<think>\nhm+ [a-z]{2,6}\n</think>\n\n[A-Z][a-z]{1,5}\."},
    )
    message = client.chat.completions.create(**request).choices[0].message
    assert re.fullmatch(r"hm+ [a-z]{2,6}", message.reasoning_content) and re.fullmatch(
        r"[A-Z][a-z]{1,5}\.", message.content
    )
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


# -- the default model fills a Pydantic model ----------------------------------------------------------
class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: Annotated[str, Field(max_length=40)]
    country: Annotated[str, Field(max_length=40)]


class Person(BaseModel):
    name: Annotated[str, Field(max_length=40)]
    age: Annotated[int, Field(ge=0, le=130)]
    favourite_colour: Colour
    hobbies: Annotated[list[Annotated[str, Field(max_length=30)]], Field(min_length=1, max_length=3)]
    address: Address


PEOPLE = [
    "a French chef",
    "a young footballer",
    "a retired teacher",
    "a pilot",
    "a painter from Spain",
    "a student",
    "a farmer",
    "a doctor in Tokyo",
    "a musician",
    "a baker",
    "a poet",
    "an engineer",
]


@pytest.fixture(scope="module")
def default_client():
    server = Server(
        os.path.join(default_model_dir(), _DEFAULT_GGUF), "--max-model-len", "1024", "--kv-cache-memory", "128MiB"
    )
    yield OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    server.stop()


def test_the_default_model_fills_a_pydantic_model_for_every_prompt(default_client):
    from concurrent.futures import ThreadPoolExecutor

    def ask(who: str):
        return default_client.chat.completions.parse(
            model=default_client.models.list().data[0].id,
            max_tokens=300,
            temperature=0,
            messages=[{"role": "user", "content": f"Invent {who}. Answer in JSON."}],
            response_format=Person,
        )

    with ThreadPoolExecutor(len(PEOPLE)) as pool:  # together: one batch
        results = list(pool.map(ask, PEOPLE))
    schema = Person.model_json_schema()
    for result in results:
        message = result.choices[0].message
        assert isinstance(message.parsed, Person), message.content
        jsonschema.validate(json.loads(message.content), schema)
    # The parsed message, dumped whole (`parsed` and the client's other fields in it), goes back as a turn.
    turn = [{"role": "user", "content": "Invent a baker."}, results[0].choices[0].message.model_dump()]
    again = default_client.chat.completions.create(
        model=default_client.models.list().data[0].id,
        messages=[*turn, {"role": "user", "content": "Thanks."}],
        max_tokens=2,
    )
    assert again.choices[0].message.content is not None


def test_a_streamed_tool_call_message_goes_back_whole(client):
    """The stream helper's final message, dumped whole (with the client's own additions: each
    call's `index` and `parsed_arguments`, `refusal`, ...), is a valid next turn."""
    with client.chat.completions.stream(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0
    ) as stream:
        streamed = stream.get_final_completion().choices[0].message
    assert streamed.tool_calls
    dumped = streamed.model_dump()
    assert "index" in dumped["tool_calls"][0] and "parsed_arguments" in dumped["tool_calls"][0]["function"]
    messages = [
        *MESSAGES,
        dumped,
        *({"role": "tool", "tool_call_id": call.id, "content": "sunny"} for call in streamed.tool_calls),
    ]
    final = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
