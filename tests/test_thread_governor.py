"""The thread governor (executor/thread_governor.py): its policy on scripted readings, the real
schedstat reading, the cgroup quota, and the invariant it relies on: greedy outputs are the same
bits whatever the thread count."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import _DEFAULT_GGUF, default_model_dir
from pagedllm.executor import thread_governor as tg
from pagedllm.executor.cpu_binding import cgroup_cpu_quota


class Script:
    """A clock and a schedstat that advance by one window of a given waiting share a step."""

    def __init__(self) -> None:
        self.now, self.run, self.wait = 0.0, 0, 0

    def window(self, waiting: float, busy_s: float = 0.2) -> None:
        self.now += tg.WINDOW_S
        self.wait += int(waiting * busy_s * 1e9)
        self.run += int((1 - waiting) * busy_s * 1e9)


def _governor(max_threads: int = 2) -> tuple[tg.ThreadGovernor, Script, list[int]]:
    script, calls = Script(), []
    governor = tg.ThreadGovernor(max_threads, calls.append, lambda: (script.run, script.wait), lambda: script.now)
    governor.stepped()  # the first step takes the first reading
    return governor, script, calls


def _step(governor: tg.ThreadGovernor, script: Script, waiting: float, busy_s: float = 0.2) -> int:
    script.window(waiting, busy_s)
    governor.stepped()
    return governor.threads


def test_a_busy_machine_takes_threads_away_and_a_quiet_one_gives_them_back():
    governor, script, calls = _governor(max_threads=3)
    assert _step(governor, script, 0.01) == 3
    assert _step(governor, script, 0.4) == 2
    assert _step(governor, script, 0.3) == 1
    assert _step(governor, script, 0.5) == 1  # never below one
    # Quiet at 1 thread: after FIRST_PROBE_S a probe of 2; it stays quiet, so 2 stays, then 3.
    threads = [_step(governor, script, 0.0) for _ in range(int(2 * tg.FIRST_PROBE_S / tg.WINDOW_S) + 2)]
    assert threads[-1] == 3 and calls == [2, 1, 2, 3]


def test_a_failed_probe_goes_back_and_waits_twice_as_long():
    governor, script, calls = _governor()
    _step(governor, script, 0.4)  # down to 1
    probes = []
    for _ in range(int(40 / tg.WINDOW_S)):  # 40 s of one busy neighbour: 1 thread waits little, 2 a lot
        if _step(governor, script, 0.4 if governor.threads == 2 else 0.02) == 2:
            probes.append(script.now)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == pytest.approx(
        [2 * tg.FIRST_PROBE_S + tg.WINDOW_S, 4 * tg.FIRST_PROBE_S + tg.WINDOW_S, tg.MAX_PROBE_S + tg.WINDOW_S]
    )
    assert max(gaps) <= tg.MAX_PROBE_S + tg.WINDOW_S
    assert governor.threads == 1 and calls[-1] == 1


def test_idle_windows_and_short_windows_decide_nothing():
    governor, script, calls = _governor()
    for _ in range(100):
        _step(governor, script, 0.9, busy_s=0.01)  # hardly any thread time: an idle engine
    script.now += tg.WINDOW_S / 2
    assert calls == []


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.lists(st.floats(0, 1), max_size=120))
def test_the_count_stays_within_bounds_and_each_change_is_one_thread(max_threads, shares):
    governor, script, calls = _governor(max_threads)
    previous = max_threads
    for share in shares:
        threads = _step(governor, script, share)
        assert 1 <= threads <= max_threads and abs(threads - previous) <= 1
        previous = threads
    assert [governor.max_threads, *calls][-1] == governor.threads


def test_schedstat_reads_the_calling_thread():
    if not tg.schedstat_available():
        pytest.skip("no schedstat on this kernel")
    run0, wait0 = tg.thread_schedstat()
    sum(range(2_000_000))
    run1, wait1 = tg.thread_schedstat()
    assert run1 > run0 and wait1 >= wait0
    other: list[tuple[int, int]] = []
    worker = threading.Thread(target=lambda: other.append(tg.thread_schedstat()))
    worker.start()
    worker.join()
    assert other[0][0] < run1  # a new thread's own time, not this one's


def test_fixed_thread_counts_get_no_governor(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(tg.ADAPTIVE_ENV, raising=False)
    assert tg.make_governor(1, print) is None
    if tg.schedstat_available():
        assert tg.make_governor(2, print) is not None
    monkeypatch.setenv(tg.ADAPTIVE_ENV, "0")
    assert tg.make_governor(2, print) is None
    monkeypatch.delenv(tg.ADAPTIVE_ENV)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert tg.make_governor(2, print) is None


def _write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_cgroup_quota_v2_v1_and_none(tmp_path):
    # cgroup v2: the tightest of the process's group and those above it.
    _write(tmp_path / "v2/proc", "0::/app/worker\n")
    _write(tmp_path / "v2/fs/app/cpu.max", "150000 100000\n")
    _write(tmp_path / "v2/fs/app/worker/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path / "v2/fs"), str(tmp_path / "v2/proc")) == 1.5
    # cgroup v1 (hybrid: the v2 line's group has no cpu.max); -1 means none.
    _write(tmp_path / "v1/proc", "4:memory:/x\n2:cpu,cpuacct:/\n0::/\n")
    _write(tmp_path / "v1/fs/cpu,cpuacct/cpu.cfs_quota_us", "250000\n")
    _write(tmp_path / "v1/fs/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(str(tmp_path / "v1/fs"), str(tmp_path / "v1/proc")) == 2.5
    _write(tmp_path / "v1/fs/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(str(tmp_path / "v1/fs"), str(tmp_path / "v1/proc")) is None
    assert cgroup_cpu_quota(str(tmp_path / "none"), str(tmp_path / "none/proc")) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
@pytest.mark.parametrize("source", ["bf16", "gguf"])
def test_greedy_outputs_are_the_same_bits_with_one_thread_or_two(source, llama_dir):
    """What lets the governor change the count between steps: a row's arithmetic does not depend
    on how many threads share the work (batched and alone, prompts and decodes)."""
    from pagedllm import LLM, SamplingParams

    path, dtype = (
        (llama_dir, "bfloat16") if source == "bf16" else (os.path.join(default_model_dir(), _DEFAULT_GGUF), "auto")
    )
    llm = LLM(path, dtype=dtype, kv_cache_memory="32MiB", max_model_len=256, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [[1] + list(range(40 + 29 * i, 40 + 29 * i + 5 + 23 * i)) for i in range(5)]
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            batch = llm.generate(prompts, params, use_tqdm=False)
            alone = llm.generate(prompts[:1], params, use_tqdm=False)
            results.append(
                [(o.outputs[0].token_ids, [sorted(e.items()) for e in o.outputs[0].logprobs]) for o in [*batch, *alone]]
            )
    finally:
        torch.set_num_threads(before)
    assert results[0] == results[1]
