"""CUDA graphs for decode steps (worker/cuda_graph.py), on the CPU: the runner's static buffers,
padding to the captured sizes and scratch block, with an eager stand-in for the capture (the GPU
check, checks/gpu/run.sh, captures real graphs); which sizes are captured and when."""

from __future__ import annotations

import pytest
import torch

from conftest import prompts_of_mixed_lengths
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine import builder
from pagedllm.worker import cuda_graph
from pagedllm.worker.cuda_graph import capture_sizes


def test_capture_sizes_cover_max_num_seqs():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(5) == (1, 2, 4, 8)
    assert capture_sizes(256)[-1] == 256 and capture_sizes(256)[3:6] == (8, 16, 24)
    assert capture_sizes(100)[-1] == 104
    assert capture_sizes(4096)[-1] == 512


def test_graphs_are_captured_on_a_gpu_unless_enforce_eager():
    assert builder.cuda_graph_sizes(EngineArgs(device="cuda")) == capture_sizes(256)
    assert builder.cuda_graph_sizes(EngineArgs(device="cuda", max_num_seqs=8)) == (1, 2, 4, 8)
    assert builder.cuda_graph_sizes(EngineArgs(device="cuda", enforce_eager=True)) == ()
    assert builder.cuda_graph_sizes(EngineArgs()) == ()  # the CPU's passes are eager


class _EagerGraph:
    """torch.cuda.CUDAGraph's part the runner uses, on the CPU: replay reruns the pass into the
    output tensor the capture returned (reading the static buffers as they are at replay)."""

    def __init__(self, run, out: torch.Tensor) -> None:
        self.run, self.out = run, out

    def replay(self) -> None:
        self.out.copy_(self.run())


def _eager_capture(run, pool):
    out = run().clone()
    return _EagerGraph(run, out), out, pool


def test_replayed_decode_steps_give_the_eager_engines_tokens(monkeypatch, tiny_models):
    """Five requests of different lengths, finishing one after another: decode steps of 5, 4, 3,
    2 and 1 requests replay the sizes 8, 4, 4, 2 and 1, their padding rows in the scratch block;
    the tokens are the eager engine's, and steps with prompts in them run eagerly."""
    path = tiny_models["llama"]
    prompts = prompts_of_mixed_lengths(49152, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    engine = dict(dtype="float32", block_size=4, kv_cache_memory="8MiB", max_num_seqs=6)
    requests = [{"prompt_token_ids": p} for p in prompts]
    eager = [o.outputs[0].token_ids for o in LLM(path, **engine).generate(requests, params, use_tqdm=False)]

    monkeypatch.setattr(builder, "cuda_graph_sizes", lambda args: capture_sizes(args.max_num_seqs))
    monkeypatch.setattr(cuda_graph, "capture_cuda_graph", _eager_capture)
    llm = LLM(path, **engine)
    runner = llm.engine.model_runner.graphs
    assert runner is not None and runner.sizes == (1, 2, 4, 8)
    sizes = []
    replay = cuda_graph.CudaGraphRunner.run
    monkeypatch.setattr(
        cuda_graph.CudaGraphRunner, "run", lambda self, ids, *a: sizes.append(len(ids)) or replay(self, ids, *a)
    )
    graphed = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    assert graphed == eager
    assert runner.replays > 0 and {5, 4, 3, 2, 1} <= set(sizes)
    assert runner.replays < len(sizes)  # the steps with a prompt's tokens ran eagerly
    # The scratch block is one past the blocks the KV manager hands out.
    assert llm.engine.model_runner.kv_caches[0][0].shape[0] == runner.scratch_block + 1


def test_the_profile_pass_runs_a_whole_step(tiny_models):
    """Worker.device_kv_budget's pass (sizing the cache on a GPU): a step of many tokens over a
    one-block cache, and the logits of its last rows."""
    from pagedllm.engine.builder import load_config
    from pagedllm.models.loader import load_model
    from pagedllm.worker.model_runner import profile_pass

    config = load_config(EngineArgs(model=tiny_models["qwen3"], dtype="float32", max_model_len=64))
    logits = profile_pass(load_model(config, "cpu"), config, 100, 7, 16, torch.device("cpu"))
    assert logits.shape == (7, config.vocab_size) and bool(logits.isfinite().all())


def test_gpu_memory_utilization_is_refused_off_a_gpu():
    with pytest.raises(ValueError, match="sizes the KV cache on a GPU"):
        EngineArgs(gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="data parallelism runs its replicas on the CPU"):
        EngineArgs(device="cuda", data_parallel_size=2)
