"""The soak's greedy check (benchmarks/soak.py): where a difference from the alone run sits, and
how far below the alone run's best the soak's pick was."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from soak import flip_gap  # noqa: E402


def steps(*entries):
    """(token, {candidate: logprob}) per step; the token is the alone run's pick."""
    return list(entries)


def test_gap_at_the_token_that_crosses_the_difference():
    alone_steps = steps(("The", {"The": -0.1, "A": -2.0}), (" cat", {" cat": -0.5, " dog": -0.8, " cow": -3.0}))
    assert flip_gap(alone_steps, "The cat", "The dog") == pytest.approx(0.3)
    assert flip_gap(alone_steps, "The cat", "The cow") == pytest.approx(2.5)
    assert flip_gap(alone_steps, "The cat", "The pig") is None  # not among the alone run's top k


def test_a_longer_token_that_starts_with_the_alone_token():
    # Alone took "n" then " to"; the soak took "ns" (a tie with "n"): the gap is at the first step.
    alone_steps = steps(("n", {"n": -1.11, "ns": -1.11, "nings": -2.5}), (" to", {" to": -0.2, " be": -1.0}))
    assert flip_gap(alone_steps, "n to be", "ns to play") == pytest.approx(0.0)
    # The same token, then a difference at the next one: the next step's gap counts.
    alone_steps = steps(("n", {"n": -1.0, "ns": -3.0}), (" to", {" to": -0.2, " for": -0.4}))
    assert flip_gap(alone_steps, "n to be", "n for me") == pytest.approx(0.2)
    # Neither explains it: not a near-tie.
    assert flip_gap(alone_steps, "n to be", "nq") is None


def test_special_tokens_left_out_of_the_text_are_skipped():
    alone_steps = steps(
        (".", {".": -0.1}),
        ("<|im_end|>", {"<|im_end|>": -0.1}),
        ("\n", {"\n": -0.5, "\n\n": -0.6}),
        ("user", {"user": -0.1}),
    )
    assert flip_gap(alone_steps, ".\nuser", ".\n\nI'll") == pytest.approx(0.1)


def test_the_soak_going_on_where_the_alone_run_ended_its_turn():
    # Alone: "." then <|im_end|> (no text) then "\n"; the soak took " I" where alone ended the turn.
    alone_steps = steps(
        (".", {".": -0.1}),
        ("<|im_end|>", {"<|im_end|>": -0.4, " I": -0.5}),
        ("\n", {"\n": -0.01}),
        ("assistant", {"assistant": -0.01}),
    )
    assert flip_gap(alone_steps, "watching.\nassistant", "watching. I've") is None  # "watching" not a step here
    alone_steps = steps(("watching", {"watching": -0.2}), *alone_steps)
    assert flip_gap(alone_steps, "watching.\nassistant", "watching. I've") == pytest.approx(0.1)


def test_the_mixed_runs_checks_of_json_tool_calls_and_embeddings():
    from soak import SCHEMA, Result, Spec, bad_calls, bad_vectors, schema_error, take_choice

    assert schema_error('{"topic": "rivers", "rating": 4}', SCHEMA) is None
    assert "schema" in schema_error('{"topic": "rivers", "rating": 9}', SCHEMA)
    assert "schema" in schema_error('{"topic": "riv', SCHEMA)
    spec = Spec(
        index=0,
        chat=True,
        stream=True,
        n=1,
        greedy=True,
        long=False,
        max_tokens=64,
        ignore_eos=False,
        seed=None,
        drop_after=None,
        prompt="?",
        kind="tools",
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    result = Result(spec)
    for delta in (
        {"tool_calls": [{"index": 0, "id": "x", "function": {"name": "get_time", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
    ):
        take_choice(result, {"index": 0, "delta": delta, "finish_reason": None}, chat=True)
    take_choice(result, {"index": 0, "delta": {}, "finish_reason": "tool_calls"}, chat=True)
    assert result.calls == {0: {0: ["get_time", '{"city": "Oslo"}']}} and bad_calls(result, spec) is None
    result.calls[0][0][0] = "get_weather"  # a tool the named choice does not allow
    assert "allowed" in bad_calls(result, spec)
    result.calls[0][0] = ["get_time", '{"city": "Lima"}']
    assert "schema" in bad_calls(result, spec)
    assert bad_vectors([[0.6, 0.8], [1.0, 0.0]], 2) is None
    assert bad_vectors([[0.6, 0.8]], 2) is not None and bad_vectors([[0.6, 0.9], [1.0, 0.0]], 2) is not None
    assert bad_vectors([[0.6, 0.8], [1.0, 0.0, 0.0]], 2) is not None


def test_lora_requests_name_their_adapter_and_are_counted(monkeypatch):
    """--lora-fraction: only text and constrained requests take an adapter, which the body names
    as its model; the check fails where /metrics counted fewer than completed, or none replayed."""
    from soak import Result, lora_check, lora_server_args, make_workload, parse_args

    monkeypatch.setattr(sys, "argv", ["soak", "--requests", "300", "--lora-fraction", "0.5", "--beams-fraction", "0.1"])
    args = parse_args()
    args.lora_paths = ["/a0", "/a1"]
    specs = make_workload(args)
    adapted = [s for s in specs if s.adapter is not None]
    assert 100 < len(adapted) < 200 and all(s.kind in ("text", "json", "tools") for s in adapted)
    assert all(s.body()["model"] == s.adapter for s in adapted)
    assert not any("model" in s.body() for s in specs if s.adapter is None)
    assert {s.adapter for s in adapted} == {"soak-lora-0", "soak-lora-1", "soak-lora-2"}
    assert any(s.kind == "beams" for s in specs) and not any(s.kind == "beams" and s.adapter for s in specs)
    served = lora_server_args(args)
    assert served[-2:] == ["soak-lora-0=/a0", "soak-lora-1=/a1"]  # the last adapter: loaded at runtime
    results = [Result(s, status=200, done=True) for s in adapted[:5]]
    assert lora_check(results, results[:2], {"pagedllm:lora_requests_total": 5.0})[1]
    assert not lora_check(results, results[:2], {"pagedllm:lora_requests_total": 4.0})[1]
    assert not lora_check(results, [], {"pagedllm:lora_requests_total": 5.0})[1]


def test_the_disk_tier_check_wants_writes_reads_and_no_failed_read():
    from soak import kv_offload_check

    good = {"pagedllm:kv_offload_write_blocks_total": 40.0, "pagedllm:kv_offload_hits_total": 12.0}
    assert kv_offload_check(good)[1]
    assert not kv_offload_check({**good, "pagedllm:kv_offload_hits_total": 0.0})[1]
    assert not kv_offload_check({**good, "pagedllm:kv_offload_failures_total": 1.0})[1]
