"""Data parallelism: engine replicas behind one frontend, the router's choices, the stats of all
replicas together and each, and a server whose replicas each serve, report and fail cleanly."""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import openai
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import prompts_of_mixed_lengths
from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache_manager import extend_block_hashes
from pagedllm.core.messages import SchedulerStats
from pagedllm.engine.dp_client import AFFINITY_SLACK, PrefixRouter
from pagedllm.sampling_params import BeamSearchParams
from server_utils import Server, kill_mid_stream

BS = 4


def test_a_shared_prefix_follows_its_replica_while_the_load_allows():
    router = PrefixRouter(2, BS, [100, 100])
    system = list(range(10, 30))  # five blocks
    assert router.choose(system + [1, 2], None, [0, 0]) == 0
    assert router.choose([7] * 9, None, [1, 0]) == 1  # nothing shared: the lighter load
    assert router.choose(system + [3], None, [1, 5]) == 0  # the prefix's replica, though busier
    assert router.choose(system + [3], None, [1 + AFFINITY_SLACK + 1, 1]) == 1  # too busy: recompute it there
    assert router.choose(system + [4, 5], None, [3, 2]) == 1  # both hold it now: the lighter load
    assert router.choose(system + [3], "salt", [0, 1]) == 0  # salted: shares nothing, the lighter load


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), min_size=1, max_size=24), st.lists(st.integers(0, 12), min_size=3, max_size=3)
        ),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 12),
)
def test_router_invariants(requests, capacity):
    """Never past the slack over the least load; a replica keeps no more blocks than it has, the
    latest prompt's first ones kept; a prompt seen before, with loads equal, goes to a replica that has it all."""
    router = PrefixRouter(3, BS, [capacity] * 3)
    for prompt, loads in requests:
        replica = router.choose(prompt, None, loads)
        assert loads[replica] <= min(loads) + AFFINITY_SLACK
        assert all(len(known) <= capacity for known in router.prefixes)
        hashes = extend_block_hashes([], prompt, BS, None, (len(prompt) - 1) // BS)
        assert all(h in router.prefixes[replica] for h in hashes[:capacity])  # a prefix's first blocks stay
        if hashes and len(hashes) <= capacity:
            holders = [r for r, known in enumerate(router.prefixes) if all(h in known for h in hashes)]
            assert replica in holders and router.choose(prompt, None, [0, 0, 0]) in holders


def test_merged_stats_add_counts_and_weigh_shares():
    a = SchedulerStats(1, 2, 100, 50, 0.5, 0.1, 3, 40, 20, spec_accepted_per_position=(4, 2))
    b = SchedulerStats(2, 0, 300, 0, 1.0, 0.3, 1, 60, 30, spec_accepted_per_position=(1,))
    merged = SchedulerStats.merge([a, b])
    assert (merged.num_running, merged.num_waiting, merged.kv_blocks_total, merged.kv_blocks_free) == (3, 2, 400, 50)
    assert merged.kv_cache_usage == pytest.approx(350 / 400)
    assert merged.kv_waste == pytest.approx((0.1 * 50 + 0.3 * 300) / 350)
    assert (merged.num_preemptions, merged.prefix_cache_queries, merged.prefix_cache_hits) == (4, 100, 50)
    assert merged.spec_accepted_per_position == (5, 2)


def _replica_processes(llm: LLM) -> list[psutil.Process]:
    return [psutil.Process(replica.pid) for replica in llm.engine.engine_core.replicas]


def test_two_replicas_give_one_engine_greedy_tokens_samples_and_beams(llama_dir):
    """Requests spread over both replicas, with the same greedy tokens as one engine; parallel
    samples and beams (forked from held requests) stay on their parent's replica."""
    args = dict(dtype="float32", max_model_len=256, kv_cache_memory="32MiB", block_size=BS)
    prompts = prompts_of_mixed_lengths(49152) * 2
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    samples = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    beams = BeamSearchParams(beam_width=3, max_tokens=5)

    def run(llm: LLM) -> tuple:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        sampled = llm.generate([{"prompt_token_ids": prompts[3]}], samples, use_tqdm=False)[0]
        beam = llm.beam_search([{"prompt_token_ids": prompts[2]}], beams)[0]
        return (
            [list(o.outputs[0].token_ids) for o in outs],
            [list(s.token_ids) for s in sampled.outputs],
            [s.tokens for s in beam.sequences],
        )

    expected = run(LLM(llama_dir, **args))
    llm = LLM(llama_dir, data_parallel_size=2, **args)
    processes = _replica_processes(llm)
    assert len(processes) == 2
    assert run(llm) == expected
    per_replica = llm.engine.replica_stats()
    assert all(s.prefix_cache_queries > 0 for s in per_replica)  # both served
    assert sum(s.prefix_cache_hits for s in per_replica) > 0  # repeated prompts found their replica's blocks
    dp = llm.engine.engine_core
    assert not dp.owner and not dp.has_unfinished_requests()
    # Every fork and beam released: an idle replica answers the releases with its stats.
    deadline = time.monotonic() + 10
    while not all(s.kv_blocks_free == s.kv_blocks_total for s in dp.replica_stats()):
        assert time.monotonic() < deadline, dp.replica_stats()
        time.sleep(0.05)
        llm.engine.refresh_stats()
    llm.engine.shutdown()
    assert not any(p.is_running() for p in processes)


def test_more_ranks_than_cores_fail_at_start_up(llama_dir):
    with pytest.raises(ValueError, match="need a core each"):
        LLM(llama_dir, data_parallel_size=psutil.cpu_count() + 1)
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        LLM(llama_dir, data_parallel_size=0)


def _metric(text: str, name: str, engine: str) -> float:
    match = re.search(rf'^pagedllm:{name}{{engine="{engine}",model_name="[^"]+"}} (\S+)$', text, re.M)
    assert match, f"no {name} for engine {engine}"
    return float(match.group(1))


def _replicas_of(pid: int) -> list[psutil.Process]:
    return [
        p for p in psutil.Process(pid).children(recursive=True) if "pagedllm.engine.core_proc" in " ".join(p.cmdline())
    ]


def test_server_with_two_replicas_serves_reports_and_fails_cleanly(llama_dir):
    """-dp 2: concurrent requests from both replicas (each replica's counters move) with equal
    greedy outputs; then a replica killed mid-stream fails the stream within seconds, the server
    exits non-zero and no process is left."""
    server = Server(
        llama_dir,
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        "--dtype",
        "float32",
        "-dp",
        "2",
        env={"PAGEDLLM_FAULT": "slow:20"},
    )  # 20 ms more a step: streams stay open
    try:
        replicas = _replicas_of(server.process.pid)
        assert len(replicas) == 2
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        prompts = [f"Story {i}: once upon a time" for i in range(4)] * 2

        def complete(prompt: str) -> str:
            return (
                client.completions.create(
                    model=llama_dir, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
                )
                .choices[0]
                .text
            )

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(complete, prompts))
        assert texts[:4] == texts[4:]
        metrics = httpx.get(f"{server.url}/metrics").text
        assert all(_metric(metrics, "prefix_cache_queries_total", e) > 0 for e in "01")
        assert all(_metric(metrics, "num_requests_running", e) == 0 for e in "01")
        # The dashboard shows each replica's pool, as /metrics counts it.
        snapshots = httpx.get(f"{server.url}/dashboard/state").json()["replicas"]
        assert [s["blocks"].count("f") + s["blocks"].count("c") for s in snapshots] == [
            _metric(metrics, "kv_cache_free_blocks", e) for e in "01"
        ]
        assert all(s["steps"] for s in snapshots)

        # The stream's replica or the idle one: either fails the engine.
        events, elapsed = kill_mid_stream(server, replicas[1].kill)
        assert elapsed < 10
        assert events[-1] == "data: [DONE]" and "engine has stopped" in events[-2]
        assert server.process.wait(timeout=30) != 0
        gone, alive = psutil.wait_procs(replicas, timeout=10)
        assert not alive
    finally:
        server.stop()
