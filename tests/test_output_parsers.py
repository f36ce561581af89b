"""Tool-call parsers (hermes, llama3_json) and reasoning parsers (deepseek_r1, qwen3): what parse()
finds in whole outputs, and that their streams, fed the same text cut anywhere, send the same."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCallDelta, ToolParser, get_tool_parser
from pagedllm.entrypoints.openai.tool_parsers.constrained import NamedFunctionOutput, RequiredFunctionsOutput
from pagedllm.reasoning import REASONING_PARSERS, ReasoningParser, get_reasoning_parser

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- helpers ------------------------------------------------------------------------------------


def cut(text: str, positions: list[int]) -> list[str]:
    """`text` in pieces at the given positions (taken modulo len+1, sorted, repeats allowed)."""
    points = sorted(p % (len(text) + 1) for p in positions)
    edges = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(edges, edges[1:])]


def stream_tools(parser: ToolParser, pieces: list[str]) -> tuple[str, list[ToolCallDelta], list]:
    """(content joined, all deltas, the stream's tool_calls) from feeding `pieces`."""
    stream = parser.stream()
    content, deltas = [], []
    for piece in pieces:
        text, new = stream.feed(piece)
        content.append(text)
        deltas.extend(new)
    text, new = stream.finish()
    content.append(text)
    deltas.extend(new)
    return "".join(content), deltas, stream.tool_calls


def reassemble(deltas: list[ToolCallDelta]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call index, as a client rebuilds them; checks the delta shape."""
    calls: dict[int, list] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.index == len(calls), "indexes start at 0 and go up by one"
            assert d.id is not None and d.name is not None, "a call's first delta has its id and name"
            calls[d.index] = [d.id, d.name, ""]
        else:
            assert d.id is None and d.name is None, "id and name only on the first delta"
        calls[d.index][2] += d.arguments
    return [tuple(calls[i]) for i in range(len(calls))]


def check_stream_matches_parse(parser: ToolParser, text: str, pieces: list[str]) -> None:
    expected = parser.parse(text)
    content, deltas, stream_calls = stream_tools(parser, pieces)
    assert content == (expected.content or "")
    rebuilt = reassemble(deltas)
    assert [(n, a) for _, n, a in rebuilt] == [(c.name, c.arguments) for c in expected.tool_calls]
    assert [(c.id, c.name, c.arguments) for c in stream_calls] == rebuilt


def stream_reasoning(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    stream = parser.stream()
    reasoning, content = [], []
    for piece in [*pieces, None]:
        r, c = stream.finish() if piece is None else stream.feed(piece)
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning), "".join(content)


def calls_of(parser: ToolParser, text: str) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parser.parse(text).tool_calls]


# ---- registries ---------------------------------------------------------------------------------


def test_registries_and_unknown_names():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    for name in TOOL_PARSERS:
        assert get_tool_parser(name).name == name
    for name in REASONING_PARSERS:
        assert get_reasoning_parser(name).name == name
    with pytest.raises(ValueError, match="hermes.*llama3_json"):
        get_tool_parser("mistral")
    with pytest.raises(ValueError, match="deepseek_r1.*qwen3"):
        get_reasoning_parser("granite")


# ---- hermes: table ------------------------------------------------------------------------------

W = {"city": "Paris", "unit": "°C"}
HERMES_CASES = [
    # (text, content, [(name, arguments)])
    ("The weather is fine.", "The weather is fine.", []),
    ("", None, []),
    ("  \n ", None, []),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>',
        None,
        [("get_weather", W)],
    ),
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}</tool_call>',
        None,
        [("get_weather", W)],
    ),
    (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
        None,
        [("a", {"x": 1}), ("b", {})],
    ),
    (
        'Let me check.\n\n<tool_call>\n{"name": "a", "arguments": {"x": [1, 2]}}\n</tool_call>\n',
        "Let me check.",
        [("a", {"x": [1, 2]})],
    ),
    ('A <tool_call>{"name": "a", "arguments": {}}</tool_call> B', "A  B", [("a", {})]),
    # arguments as a JSON string holding an object
    ('<tool_call>{"name": "a", "arguments": "{\\"q\\": \\"日本\\"}"}</tool_call>', None, [("a", {"q": "日本"})]),
    # missing arguments: {}
    ('<tool_call>{"name": "a"}</tool_call>', None, [("a", {})]),
    # malformed JSON: the span, tags included, is content; the valid call after it still counts
    (
        '<tool_call>{"name": "a", "arguments": {</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "a", "arguments": {</tool_call>',
        [("b", {})],
    ),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    (
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>',
        '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>',
        [],
    ),
    # unclosed: content to the end
    ('Sure. <tool_call>\n{"name": "a", "arguments": {}}', 'Sure. <tool_call>\n{"name": "a", "arguments": {}}', []),
    (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b"',
        'then <tool_call>{"name": "b"',
        [("a", {})],
    ),
    # lookalikes of the tags are plain text
    ("use <tool_calls> or </tool_call> here", "use <tool_calls> or </tool_call> here", []),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_parse(text, content, calls):
    parser = get_tool_parser("hermes")
    result = parser.parse(text)
    assert result.content == content
    assert calls_of(parser, text) == calls
    for call in result.tool_calls:  # arguments are the object's JSON, non-ASCII kept as is
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
        assert call.id.startswith("chatcmpl-tool-")
    assert len({c.id for c in result.tool_calls}) == len(result.tool_calls)
    # whole, and one character at a time
    check_stream_matches_parse(parser, text, [text])
    check_stream_matches_parse(parser, text, list(text))


def test_hermes_stream_sends_content_early_and_holds_partial_tags():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hi <tool") == ("Hi", [])  # the space is held (trailing) and so is "<tool"
    assert stream.feed("s are") == (" <tools are", [])  # not a tag after all: released
    assert stream.feed(' here.\n<tool_call>\n{"name": ') == (" here.", [])
    assert stream.feed('"f", "arguments": {"a": 1}}\n</tool_') == ("", [])
    content, deltas = stream.feed("call>\n")
    assert content == ""
    call = stream.tool_calls[0]
    assert deltas == [
        ToolCallDelta(index=0, id=call.id, name="f", arguments=""),
        ToolCallDelta(index=0, arguments='{"a": 1}'),
    ]
    assert stream.finish() == ("", [])


# ---- hermes: properties -------------------------------------------------------------------------

# Text drawn from the characters tags and JSON are made of, so that cuts and lookalikes are common.
TAGGY = st.text(alphabet=st.sampled_from(list('<>/_tool_call{}":, \n') + ["é", "日", "🙂", "x"]), max_size=12)
NAMES = st.text(alphabet="abcdefghij_", min_size=1, max_size=8)
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
ARGS = st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=4)
SPACE = st.sampled_from(["", "\n", " ", "\n\n", " \t"])


@st.composite
def hermes_call(draw) -> tuple[str, str, str]:
    """(markup, name, expected arguments) of one valid call, in one of the ways models write them."""
    # (No generated string is long enough to hold "</tool_call>", which would end the call early.)
    name, args = draw(NAMES), draw(ARGS)
    as_string = draw(st.booleans())
    obj = {"name": name, "arguments": json.dumps(args) if as_string else args}
    body = json.dumps(obj, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 2])))
    return (f"<tool_call>{draw(SPACE)}{body}{draw(SPACE)}</tool_call>", name, json.dumps(args, ensure_ascii=False))


HERMES_JUNK = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<tool_call>{",
        '<tool_call>{"name": 1}</tool_call>',
        '<tool_call>{"name": "x", "arguments": {}',
        "<tool_",
        "</tool_c",
    ]
)


@given(
    parts=st.lists(TAGGY | HERMES_JUNK | hermes_call().map(lambda c: c[0]), max_size=8),
    positions=st.lists(st.integers(min_value=0), max_size=12),
)
@PROPERTY
def test_hermes_stream_matches_parse_for_any_text_and_cuts(parts, positions):
    text = "".join(parts)
    check_stream_matches_parse(get_tool_parser("hermes"), text, cut(text, positions))


@given(data=st.data(), n=st.integers(0, 3))
@PROPERTY
def test_hermes_finds_each_call_and_keeps_the_rest(data, n):
    texts = [data.draw(TAGGY.filter(lambda t: "<tool_call>" not in t)) for _ in range(n + 1)]
    calls = [data.draw(hermes_call()) for _ in range(n)]
    text = texts[0] + "".join(markup + t for (markup, _, _), t in zip(calls, texts[1:]))
    result = get_tool_parser("hermes").parse(text)
    assert result.content == ("".join(texts).strip() or None)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [(name, args) for _, name, args in calls]


# ---- llama3_json: table -------------------------------------------------------------------------

LLAMA_CASES = [
    ("The answer is 4.", "The answer is 4.", []),
    ("  Hello {not a call}\n", "Hello {not a call}", []),
    ("", None, []),
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}', None, [("get_weather", W)]),
    ('  {"name": "a", "arguments": {"x": 1}}\n', None, [("a", {"x": 1})]),
    ('<|python_tag|>{"name": "a", "parameters": {}}', None, [("a", {})]),
    (
        '<|python_tag|> {"name": "a", "parameters": {"x": true}}; {"name": "b", "parameters": {"y": null}}',
        None,
        [("a", {"x": True}), ("b", {"y": None})],
    ),
    ('{"name": "a", "parameters": {}};{"name": "b", "parameters": {}}', None, [("a", {}), ("b", {})]),
    ('{"name": "a", "parameters": {}} ;\n {"name": "b", "parameters": {}};', None, [("a", {}), ("b", {})]),
    ('{"name": "a", "parameters": "{\\"q\\": 1}"}', None, [("a", {"q": 1})]),  # arguments as a string
    # starts like calls but is not: all content
    ('{"name": "a", "parameters": {}} and then some text', '{"name": "a", "parameters": {}} and then some text', []),
    ('{"name": "a", "parameters": {}}; oops', '{"name": "a", "parameters": {}}; oops', []),
    ('{"result": 42}', '{"result": 42}', []),
    ('{"name": "a", "parameters": {', '{"name": "a", "parameters": {', []),  # never closes
    ('{"name": "a", "parameters": [1, 2]}', '{"name": "a", "parameters": [1, 2]}', []),
    ("<|python_tag|>", "<|python_tag|>", []),
    ('<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    ('Sure: {"name": "a", "parameters": {}}', 'Sure: {"name": "a", "parameters": {}}', []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_parse(text, content, calls):
    parser = get_tool_parser("llama3_json")
    assert parser.parse(text).content == content
    assert calls_of(parser, text) == calls
    check_stream_matches_parse(parser, text, [text])
    check_stream_matches_parse(parser, text, list(text))


def test_llama3_stream_decides_early_when_it_is_content():
    parser = get_tool_parser("llama3_json")
    stream = parser.stream()
    assert stream.feed("  ") == ("", [])
    assert stream.feed("Hel") == ("Hel", [])  # not "{" nor the tag: content at once
    assert stream.feed("lo") == ("lo", [])

    stream = parser.stream()
    assert stream.feed("<|python_") == ("", [])
    assert stream.feed('tag|>{"name": "f", "parameters": {"a": 1}}') == ("", [])  # may be more calls
    assert stream.feed(" and") == ('<|python_tag|>{"name": "f", "parameters": {"a": 1}} and', [])
    assert stream.finish() == ("", [])

    stream = parser.stream()
    assert stream.feed('{"answer": ') == ("", [])
    assert stream.feed("42}") == ('{"answer": 42}', [])  # an object that is not a call

    stream = parser.stream()
    assert stream.feed('{"name": "f", "parameters": {}}; {"name": "g"') == ("", [])
    content, deltas = stream.finish()
    assert content == '{"name": "f", "parameters": {}}; {"name": "g"'  # the second never closed
    assert deltas == [] and stream.tool_calls == []

    stream = parser.stream()
    assert stream.feed('{"name": "f", "parameters": {}}') == ("", [])
    content, deltas = stream.finish()
    call = stream.tool_calls[0]
    assert (content, deltas) == (
        "",
        [ToolCallDelta(index=0, id=call.id, name="f"), ToolCallDelta(index=0, arguments="{}")],
    )


# ---- llama3_json: properties --------------------------------------------------------------------


@st.composite
def llama_output(draw) -> tuple[str, list[tuple[str, str]]]:
    """(text, expected calls) of a valid output of 1-3 calls, written in the ways Llama writes them."""
    calls, objs = [], []
    for _ in range(draw(st.integers(1, 3))):
        name, args = draw(NAMES), draw(ARGS)
        key = draw(st.sampled_from(["parameters", "arguments"]))
        value = json.dumps(args) if draw(st.booleans()) else args
        objs.append(json.dumps({"name": name, key: value}, ensure_ascii=draw(st.booleans())))
        calls.append((name, json.dumps(args, ensure_ascii=False)))
    seps = [draw(st.sampled_from([";", "; ", " ;\n", ";\n\n"])) for _ in objs[1:]]
    body = objs[0] + "".join(sep + obj for sep, obj in zip(seps, objs[1:]))
    text = (
        draw(SPACE)
        + draw(st.sampled_from(["", "<|python_tag|>", "<|python_tag|> "]))
        + body
        + draw(st.sampled_from(["", ";", "\n", " ;\n"]))
    )
    return text, calls


@given(output=llama_output())
@PROPERTY
def test_llama3_finds_the_calls(output):
    text, calls = output
    result = get_tool_parser("llama3_json").parse(text)
    assert result.content is None
    assert [(c.name, c.arguments) for c in result.tool_calls] == calls


@given(
    output=llama_output(),
    junk=st.text(alphabet=st.sampled_from(list('{}";: ax<|') + ["é", "🙂"]), max_size=6),
    where=st.integers(min_value=0),
    truncate=st.booleans(),
    positions=st.lists(st.integers(min_value=0), max_size=12),
)
@PROPERTY
def test_llama3_stream_matches_parse_for_damaged_outputs_and_any_cuts(output, junk, where, truncate, positions):
    text = output[0]
    where %= len(text) + 1
    text = text[:where] if truncate else text[:where] + junk + text[where:]
    check_stream_matches_parse(get_tool_parser("llama3_json"), text, cut(text, positions))


# ---- reasoning: table ---------------------------------------------------------------------------

R1_CASES = [
    # (text, reasoning, content)
    ("\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("<think>\nHmm.\n</think>\n\nYes.\n", "Hmm.", "Yes.\n"),
    ("Still thinking, cut off", "Still thinking, cut off", None),
    ("</think>Just the answer", None, "Just the answer"),
    ("", None, None),
    ("\n\n</think>\n\n", None, None),
    ("a </thinking> b </think> c </think>", "a </thinking> b ", " c </think>"),  # only the first closes
    (" <think>x</think>y", " <think>x", "y"),  # <think> only dropped at the very start
]

QWEN3_CASES = [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("\n <think>x</think>y", "x", "y"),
    ("The answer is 4.", None, "The answer is 4."),  # thinking switched off
    ("  plain with a </think> in it\n", None, "  plain with a </think> in it\n"),
    ("<think>\nnever closes\n", "never closes", None),
    ("<think>\n\n</think>\n\nHi", None, "Hi"),
    ("<think>", None, None),
    ("<thinking>no</thinking>", None, "<thinking>no</thinking>"),
    ("", None, None),
    ("<think>a\n\nb</think>\n\n\nc\n\n", "a\n\nb", "c\n\n"),
]


@pytest.mark.parametrize(
    "name,text,reasoning,content", [("deepseek_r1", *c) for c in R1_CASES] + [("qwen3", *c) for c in QWEN3_CASES]
)
def test_reasoning_parse(name, text, reasoning, content):
    parser = get_reasoning_parser(name)
    assert parser.parse(text) == (reasoning, content)
    assert stream_reasoning(parser, [text]) == (reasoning or "", content or "")
    assert stream_reasoning(parser, list(text)) == (reasoning or "", content or "")


def test_reasoning_stream_holds_a_cut_tag_and_releases_a_false_one():
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed(" <thi") == ("", "")
    assert stream.feed("nk>\nStep one.\n") == ("Step one.", "")  # the trailing newline waits
    assert stream.feed("</thi") == ("", "")
    assert stream.feed("s is not it.</thi") == ("\n</this is not it.", "")
    assert stream.feed("nk>\n\nAnswer") == ("", "Answer")
    assert stream.finish() == ("", "")

    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<thin") == ("", "")
    assert stream.feed("g") == ("", "<thing")  # not a think tag: content

    stream = get_reasoning_parser("deepseek_r1").stream()
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ought") == ("<thought", "")  # deepseek_r1: reasoning from the start
    assert stream.finish() == ("", "")


# ---- reasoning: properties ----------------------------------------------------------------------

THINKY = st.lists(
    st.sampled_from(["<think>", "</think>", "<thi", "</th", "nk>", "\n", "\n\n", " ", "x", "é🙂", "<", "/", ">"])
    | st.text(max_size=5),
    max_size=12,
).map("".join)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@given(text=THINKY, positions=st.lists(st.integers(min_value=0), max_size=12))
@PROPERTY
def test_reasoning_stream_matches_parse_for_any_text_and_cuts(name, text, positions):
    parser = get_reasoning_parser(name)
    reasoning, content = parser.parse(text)
    assert stream_reasoning(parser, cut(text, positions)) == (reasoning or "", content or "")


BODY = st.text(alphabet=st.sampled_from(list("ab <>/\n") + ["é", "🙂"]), max_size=15)


@given(
    lead=st.sampled_from(["", "\n", "  \n"]),
    reasoning=BODY.filter(lambda t: "</think>" not in t),
    sep=st.sampled_from(["", "\n", "\n\n"]),
    content=BODY,
)
@PROPERTY
def test_qwen3_splits_a_thinking_output(lead, reasoning, sep, content):
    text = f"{lead}<think>{reasoning}</think>{sep}{content}"
    assert get_reasoning_parser("qwen3").parse(text) == (reasoning.strip("\n") or None, content.lstrip("\n") or None)
    # deepseek_r1 reads the same output after its template opened <think>
    assert get_reasoning_parser("deepseek_r1").parse(text.lstrip()) == (
        reasoning.strip("\n") or None,
        content.lstrip("\n") or None,
    )


# -- the outputs tool_choice "required" and a named function are constrained to ------------------

REQUIRED_TEXT = (
    '[{"name": "f", "parameters": {"q": "a \\\\\\" ] } [ {"}}, {"name": "g", "parameters": {"n": [1, {"x": 2}]}}]'
)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(REQUIRED_TEXT)), max_size=12))
def test_required_calls_stream_as_each_completes(cuts):
    parser = RequiredFunctionsOutput()
    whole = parser.parse(REQUIRED_TEXT)
    assert [c.name for c in whole.tool_calls] == ["f", "g"] and whole.content is None
    assert json.loads(whole.tool_calls[0].arguments) == {"q": 'a \\" ] } [ {'}
    stream = parser.stream()
    pieces = [REQUIRED_TEXT[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(REQUIRED_TEXT)])]
    deltas, first_call_at = [], None
    for i, piece in enumerate(pieces):
        content, new = stream.feed(piece)
        assert content == ""
        deltas += new
        if new and first_call_at is None:
            first_call_at = sum(map(len, pieces[: i + 1]))
    assert stream.finish() == ("", [])
    f_end = REQUIRED_TEXT.index("}}, ") + 2
    ends = [sum(map(len, pieces[: i + 1])) for i in range(len(pieces))]
    assert first_call_at == min(e for e in ends if e >= f_end)  # f went out with the piece that completed it
    joined = {}
    for d in deltas:
        joined.setdefault(d.index, ["", ""])
        joined[d.index][0] += d.name or ""
        joined[d.index][1] += d.arguments
    assert [tuple(v) for _, v in sorted(joined.items())] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert [c.id for c in stream.tool_calls] == [d.id for d in deltas if d.id]


def test_constrained_outputs_cut_short_are_content():
    assert RequiredFunctionsOutput().parse('[{"name": "f", "param').content == '[{"name": "f", "param'
    named = NamedFunctionOutput("f")
    assert named.parse('{"a": 1}').tool_calls[0].arguments == '{"a": 1}'
    assert named.parse('{"a": ').tool_calls == []
    stream = named.stream()
    assert stream.feed('{"a"')[1][0].name == "f" and stream.feed(": 1}")[1][0].arguments == ": 1}"
    stream.finish()
    assert [c.arguments for c in stream.tool_calls] == ['{"a": 1}']
