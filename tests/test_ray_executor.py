"""The Ray executor: tensor-parallel ranks as Ray actors on a local Ray instance the tests start
(num_cpus=2) and stop, with outputs equal to one rank's, through shared memory and through gloo
(the path ranks on several machines take), a rank's death, and bad set-ups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import prompts_of_mixed_lengths
from pagedllm import LLM, SamplingParams
from pagedllm.executor import ray_executor

ray = pytest.importorskip("ray")
ARGS = dict(dtype="float32", max_model_len=256, kv_cache_memory="16MiB")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _executor(llm: LLM) -> ray_executor.RayExecutor:
    return llm.engine.core.executor


@pytest.mark.parametrize("shared_memory", [True, False])
def test_ray_ranks_give_one_rank_greedy_tokens(local_ray, llama_dir, monkeypatch, shared_memory):
    """Through the shared-memory region (ranks on the engine's machine), and through gloo over TCP,
    as ranks on other machines would be."""
    if not shared_memory:
        monkeypatch.setattr(ray_executor, "same_machine", lambda nodes, engine_node: False)
    prompts = prompts_of_mixed_lengths(49152)
    one = _greedy(LLM(llama_dir, **ARGS), prompts)
    llm = LLM(llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **ARGS)
    state = _executor(llm).state
    assert len(state.actors) == 2 and (state.region is not None) == shared_memory
    assert _greedy(llm, prompts) == one
    llm.engine.shutdown()
    _assert_gone(state.pids)
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


def test_a_dead_ray_rank_fails_the_engine_at_once(local_ray, llama_dir):
    llm = LLM(llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **ARGS)
    _greedy(llm, [[5, 6, 7]], 2)
    os.kill(_executor(llm).state.pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(Exception, match="rank 1 died"):
        _greedy(llm, [[5, 6, 7]], 4)
    assert time.monotonic() - start < 10
    llm.engine.shutdown()
    _assert_gone(_executor(llm).state.pids)


def _assert_gone(pids: list[int]) -> None:
    gone, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=10)
    assert not alive


def test_bad_ray_set_ups_fail_at_start_up(local_ray, llama_dir, monkeypatch):
    with pytest.raises(ValueError, match="the Ray cluster has 2 CPUs: 4 tensor-parallel ranks need one each"):
        LLM(llama_dir, tensor_parallel_size=4, distributed_executor_backend="ray", **ARGS)
    with pytest.raises(ValueError, match="data-parallel replicas run as local processes"):
        LLM(llama_dir, data_parallel_size=2, distributed_executor_backend="ray", **ARGS)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ValueError, match=r"needs Ray: pip install 'pagedllm\[ray\]'"):
        LLM(llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **ARGS)


def test_ranks_get_equal_cpus_each_on_one_machine():
    assert ray_executor.cpus_per_rank([16, 16], 3) == 8  # two fit a machine of 16
    assert ray_executor.cpus_per_rank([4, 32], 2) == 16  # both on the large one
    assert ray_executor.cpus_per_rank([2], 2) == 1 and ray_executor.cpus_per_rank([1], 2) == 0


def test_an_unreachable_ray_cluster_fails_in_seconds(llama_dir):
    script = (
        "from pagedllm import LLM\n"
        f"LLM({llama_dir!r}, tensor_parallel_size=2, distributed_executor_backend='ray', dtype='float32')"
    )
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"},
    )
    assert result.returncode != 0 and "no Ray cluster is reachable at RAY_ADDRESS=127.0.0.1:1" in result.stderr
    assert time.monotonic() - start < 60
