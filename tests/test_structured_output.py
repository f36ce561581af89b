"""Structured output in the engine: constraints hold on every output (greedy and sampled, n > 1),
unconstrained requests beside them are unchanged, grammars compile off the loop and are cached,
bad constraints are refused before anything is queued, and a grammar that fails ends only its request."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.xgrammar_backend import XgrammarBackend

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "boolean"}},
            "required": ["kind", "legs"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", 'say "maybe"', "naïve"]
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "xy"'
PROMPTS = ["Describe someone:", "A list of things", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", block_size=4)


def _constraints() -> list[tuple[StructuredOutputsParams, object]]:
    """(constraint, check of one output's text)"""
    return [
        (
            StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
            lambda text: jsonschema.validate(json.loads(text), SCHEMA),
        ),
        (StructuredOutputsParams(regex=REGEX), lambda text: _assert(re.fullmatch(REGEX, text), text)),
        (StructuredOutputsParams(choice=CHOICES), lambda text: _assert(text in CHOICES, text)),
        (
            StructuredOutputsParams(grammar=GRAMMAR),
            lambda text: _assert(re.fullmatch(r"\((?:[a-c]|xy)(?:,(?:[a-c]|xy))*\)", text), text),
        ),
    ]


def _assert(ok, text: str) -> None:
    assert ok, f"output {text!r} breaks its constraint"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_holds_its_constraint(llm, temperature):
    for constraint, check in _constraints():
        params = SamplingParams(
            temperature=temperature,
            n=1 if temperature == 0 else 3,
            seed=7,
            max_tokens=120,
            structured_outputs=constraint,
        )
        for output in llm.generate(PROMPTS, params, use_tqdm=False):
            for sample in output.outputs:
                assert sample.finish_reason == "stop", (constraint, sample.text)
                check(sample.text)


def test_json_object_is_a_json_object(llm):
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=200,
        n=2,
        structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    )
    samples = [s for o in llm.generate(PROMPTS, params, use_tqdm=False) for s in o.outputs]
    finished = [s.text for s in samples if s.finish_reason == "stop"]
    assert finished, [s.text for s in samples]
    for text in finished:
        assert isinstance(json.loads(text), dict)


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm):
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free, use_tqdm=False)]
    mixed_params = []
    for i in range(len(PROMPTS)):
        mixed_params += [free, SamplingParams(temperature=0, max_tokens=16, structured_outputs=_constraints()[i][0])]
    mixed = llm.generate([p for p in PROMPTS for _ in range(2)], mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[::2]] == alone


def test_max_tokens_inside_the_constraint_finishes_with_length(llm):
    params = SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    sample = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert sample.finish_reason == "length" and len(sample.token_ids) == 3


@pytest.mark.parametrize(
    "constraint, reason",
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "strnig"}}}), "strnig"),
        (dict(json="{not json"), "json"),
        (dict(regex="[a-"), "regex"),
        (dict(grammar="root ::= undefined_rule"), "undefined_rule"),
    ],
)
def test_a_bad_constraint_is_refused_before_anything_is_queued(llm, constraint, reason):
    good = SamplingParams(max_tokens=2)
    bad = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=re.escape(reason)):
        llm.generate(PROMPTS[:2], [good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "fields", [dict(), dict(json=SCHEMA, regex="a"), dict(choice=[]), dict(choice="ab"), dict(regex="")]
)
def test_structured_outputs_params_take_exactly_one_valid_constraint(fields):
    with pytest.raises(ValueError):
        StructuredOutputsParams(**fields)


def test_grammars_compile_off_the_loop_once_per_text(llm):
    """A grammar that takes long to compile holds back only its own request; the same text again
    compiles no more."""
    engine = llm.engine
    manager = engine.core.structured_output
    release = threading.Event()
    compile_ = manager.backend.compile

    def slow_compile(key):
        assert release.wait(30)
        return compile_(key)

    manager.backend.compile = slow_compile
    try:
        constraint = StructuredOutputsParams(regex="[a-z]{1,5}z")
        engine.add_request(
            "slow", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, structured_outputs=constraint)
        )
        engine.add_request("free", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        finished: dict[str, object] = {}
        while "free" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert "slow" not in finished and engine.has_unfinished_requests()
        release.set()
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert re.fullmatch("[a-z]{1,5}z", finished["slow"].outputs[0].text)
    finally:
        manager.backend.compile = compile_
    compiled = manager.stats.grammars_compiled
    again = SamplingParams(temperature=1.0, n=2, seed=1, max_tokens=8, structured_outputs=constraint)
    llm.generate(PROMPTS, again, use_tqdm=False)
    assert manager.stats.grammars_compiled == compiled


def test_a_grammar_that_fails_to_compile_ends_only_its_request(llm):
    manager = llm.engine.core.structured_output
    compile_ = manager.backend.compile

    def failing(key):
        raise RuntimeError("out of grammar memory")

    manager.backend.compile = failing
    try:
        params = [
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
            SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]+q")),
        ]
        free, failed = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        manager.backend.compile = compile_
    assert len(free.outputs[0].token_ids) == 4
    assert failed.outputs[0].finish_reason == "error" and "out of grammar memory" in failed.error
    assert not llm.engine.has_unfinished_requests()


def test_an_abort_while_the_grammar_compiles_leaves_nothing(llm):
    engine = llm.engine
    manager = engine.core.structured_output
    release = threading.Event()
    compile_ = manager.backend.compile
    manager.backend.compile = lambda key: (release.wait(30), compile_(key))[1]
    try:
        engine.add_request(
            "waits",
            PROMPTS[0],
            SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]+w")),
        )
        assert engine.has_unfinished_requests() and engine.stats().num_waiting == 1
        engine.abort_request("waits")
        assert not engine.has_unfinished_requests()
    finally:
        release.set()
        manager.backend.compile = compile_


def test_a_matcher_rolls_back_rejected_tokens(llm):
    """What speculative decoding's rejected drafts need: the matcher returns to where it was."""
    tokenizer = llm.get_tokenizer()
    backend = XgrammarBackend(lambda: tokenizer, llm.engine.model_config.vocab_size, [tokenizer.eos_token_id])
    matcher = backend.matcher(backend.compile(("regex", "ab(c|d)", False)))
    ids = {text: tokenizer.convert_tokens_to_ids(text) for text in "abcd"}
    assert matcher.accept_token(ids["a"]) and matcher.accept_token(ids["b"]) and matcher.accept_token(ids["c"])
    matcher.rollback(1)
    assert matcher.accept_token(ids["d"]) and not matcher.accept_token(ids["a"])
    before, after = backend.allocate_bitmask(1), backend.allocate_bitmask(1)
    matcher.rollback(2)
    matcher.fill_bitmask(before, 0)
    assert matcher.accept_token(ids["b"])
    matcher.rollback(1)
    matcher.fill_bitmask(after, 0)
    assert (before == after).all() and not (before == -1).all()


def test_bounded_json_strings_refuse_raw_control_characters(llm):
    """xgrammar 0.2.8's strings with maxLength let raw control characters through (its issue #800),
    which is not JSON; the backend's grammar refuses them."""
    tokenizer = llm.get_tokenizer()
    backend = XgrammarBackend(lambda: tokenizer, llm.engine.model_config.vocab_size, [tokenizer.eos_token_id])
    compiled = backend.compile(
        (
            "json",
            json.dumps({"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}}, "required": ["a"]}),
            True,
        )
    )

    def accepts(text: str) -> bool:
        matcher = backend.matcher(compiled)
        return (
            all(matcher.accept_token(t) for t in tokenizer.encode(text))
            and matcher.accept_token(tokenizer.eos_token_id)
            and matcher.is_terminated()
        )

    assert accepts('{"a": "ab"}') and accepts('{"a": "éa b"}')
    assert not accepts('{"a": "a\x1bb"}') and not accepts('{"a": "a\tb"}') and not accepts('{"a": "abcde"}')


def test_min_tokens_past_the_grammars_end_fails_only_that_request(llm):
    """A complete grammar allows only its end (EOS), which min_tokens bars: the request ends with an
    error saying so; the others go on."""
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(
            temperature=0,
            max_tokens=20,
            min_tokens=10,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
        ),
    ]
    free, failed = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert len(free.outputs[0].token_ids) == 6
    assert failed.outputs[0].finish_reason == "error" and "min_tokens" in failed.error
