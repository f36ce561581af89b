"""Tensor parallelism: each rank's share of the layers, the worker processes, and outputs equal to
one rank's, token for token."""

from __future__ import annotations

import os
import signal
import threading
import time
from multiprocessing import shared_memory

import httpx
import psutil
import pytest
import torch

from conftest import make_model, prompts_of_mixed_lengths
from gguf_writer import write_gguf
from pagedllm import LLM, SamplingParams
from pagedllm.distributed import parallel_state
from pagedllm.distributed.parallel_state import HeadShare, TensorParallel, check_head_split, head_share
from pagedllm.executor import cpu_binding
from pagedllm.executor.cpu_binding import parse_cpu_binding
from pagedllm.kernels import cpu_ops
from pagedllm.layers.quantization.gguf import GGUFTensor, columns_in_blocks
from server_utils import Server, kill_mid_stream


def test_heads_split_by_whole_groups_and_replicate_the_few():
    shares = lambda heads, kv, size: [head_share(heads, kv, TensorParallel(r, size)) for r in range(size)]  # noqa: E731
    # The default model: 9 heads reading 3 K/V heads (groups of 3) over 2 ranks: 2 groups and 1.
    assert shares(9, 3, 2) == [HeadShare(0, 6, 0, 2), HeadShare(6, 3, 2, 1)]
    # 4 heads, 2 K/V heads over 4 ranks: each K/V head on 2 ranks, which split its 2 query heads.
    assert shares(4, 2, 4) == [
        HeadShare(0, 1, 0, 1),
        HeadShare(1, 1, 0, 1),
        HeadShare(2, 1, 1, 1),
        HeadShare(3, 1, 1, 1),
    ]
    check_head_split(9, 3, 2)
    with pytest.raises(ValueError, match="neither split"):
        check_head_split(4, 2, 3)  # 2 K/V heads over 3 ranks
    with pytest.raises(ValueError, match="neither split"):
        check_head_split(2, 2, 4)  # a group of 1 query head cannot split over 2 ranks
    assert [TensorParallel(r, 3).split(10) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]


def test_cpu_binding():
    assert parse_cpu_binding(None, 2, [0, 1]) == [[0], [1]]
    assert parse_cpu_binding("auto", 2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert parse_cpu_binding("0-1,4|2-3,5", 2, [0]) == [[0, 1, 4], [2, 3, 5]]
    with pytest.raises(ValueError, match="as many cores"):
        parse_cpu_binding("0-1|2", 2, [0])  # ranks with other thread counts could sample apart
    assert parse_cpu_binding("all", 4, [0, 1]) is None
    with pytest.raises(ValueError, match="need a core each"):
        parse_cpu_binding("auto", 3, [0, 1])
    with pytest.raises(ValueError, match="2 core lists for 3 ranks"):
        parse_cpu_binding("0|1", 3, [0, 1])
    with pytest.raises(ValueError, match="core lists like"):
        parse_cpu_binding("0|x", 2, [0, 1])


def test_auto_binding_gives_each_rank_whole_numa_nodes(monkeypatch):
    # Two sockets, a NUMA node each, CPUs numbered alternately between them, hyper-threads n and n + 8.
    monkeypatch.setattr(cpu_binding, "cpu_topology", lambda cpu: (cpu % 2, cpu % 2, cpu % 8 // 2))
    assert parse_cpu_binding("auto", 2, list(range(16))) == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]
    assert parse_cpu_binding("auto", 4, list(range(16))) == [
        [0, 2, 8, 10],
        [4, 6, 12, 14],
        [1, 3, 9, 11],
        [5, 7, 13, 15],
    ]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _processes(llm: LLM) -> list:
    return llm.engine.core.executor.processes


# (Llama in fp32 runs in the fault tests below; Qwen2's q/k/v biases are split in the uneven test's
# biased Llama: each case starts two rank processes, ~9 s.)
_BF16_SHARES_IN_FP32 = pytest.mark.skipif(
    cpu_ops() is None, reason="without the C++ kernels, F.linear rounds each rank's bf16 share before the sum"
)


@pytest.mark.parametrize(
    "arch, dtype",
    [
        ("qwen3", "float32"),
        ("mistral", "float32"),
        pytest.param("llama", "bfloat16", marks=_BF16_SHARES_IN_FP32),
        pytest.param("qwen3", "bfloat16", marks=_BF16_SHARES_IN_FP32),
    ],
)
def test_two_ranks_give_one_rank_greedy_tokens(tiny_models, arch, dtype):
    """The heads, K/V heads, MLP features and vocabulary split over 2 worker processes, with qkv
    biases (Qwen2), per-head q/k norms (Qwen3), a sliding window (Mistral), a tied head (Llama).
    In bf16 the row-parallel layers' shares are added in fp32 and rounded once, as one rank's sum
    is (our kernels'; not F.linear's); they still add in another order, which on a larger
    model can tip a bf16 rounding and, many layers on, a token (docs/benchmarks-history.md, issue
    25): tensor parallelism is batch-invariant but not rank-count-invariant in bf16."""
    prompts = prompts_of_mixed_lengths(49152)
    args = dict(dtype=dtype, max_model_len=256, kv_cache_memory="16MiB", enable_prefix_caching=False)
    one = _greedy(LLM(tiny_models[arch], **args), prompts)
    llm = LLM(tiny_models[arch], tensor_parallel_size=2, **args)
    processes = _processes(llm)
    assert len(processes) == 2 and all(p.poll() is None for p in processes)
    assert _greedy(llm, prompts) == one
    llm.engine.shutdown()
    assert all(p.poll() is not None for p in processes)


@pytest.mark.slow
def test_a_dead_rank_fails_the_engine_at_once(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB", tensor_parallel_size=2)
    processes = _processes(llm)
    _greedy(llm, [[5, 6, 7]], 2)
    os.kill(processes[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(Exception, match="rank 1 died"):
        _greedy(llm, [[5, 6, 7]], 4)
    assert time.monotonic() - start < 10
    llm.engine.shutdown()
    assert all(p.poll() is not None for p in processes)


def test_bad_sizes_fail_at_start_up(llama_dir):
    with pytest.raises(ValueError, match="2 K/V heads .* neither split"):
        LLM(llama_dir, dtype="float32", tensor_parallel_size=3)


@pytest.mark.parametrize(
    "overrides",
    [
        # 6 heads over 3 K/V heads: 2 groups on rank 0, 1 on rank 1; an o_proj bias (added by rank 0
        # alone); an odd vocabulary (rank 0 holds one row more; rank 1's logits padded for the gather)
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, attention_bias=True, vocab_size=49153),
        dict(num_attention_heads=4, num_key_value_heads=1),  # one K/V head, held by both ranks
    ],
)
def test_uneven_and_replicated_heads_give_one_rank_tokens(tmp_path, tokenizer_dir, overrides):
    path = make_model("llama", tmp_path, tokenizer_dir, **overrides)
    prompts = prompts_of_mixed_lengths(49152)
    args = dict(dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    llm = LLM(path, tensor_parallel_size=2, **args)
    assert _greedy(llm, prompts) == _greedy(LLM(path, **args), prompts)
    llm.engine.shutdown()


@pytest.mark.skipif(cpu_ops() is None, reason="the quantized kernels need the C++ toolchain")
@pytest.mark.parametrize("quantization, dtype", [("int8", "bfloat16"), ("int4_g32", "float32"), ("Q4_1", "bfloat16")])
def test_quantized_weights_split_as_one_rank_computes_them(llama_dir, tokenizer_dir, tmp_path, quantization, dtype):
    """Online int8 (its row-parallel scales over whole rows) and int4 groups, and a GGUF file's
    blocks (a rank's rows, or its columns in whole blocks), its quantized table tied to the head:
    a rank's rows of it stay quantized for the head, as one rank's head computes. Row-parallel
    shares stay fp32 until summed. Equal tokens on a 2-layer model; on the default model's 30
    layers the quantized activations turn the order of the sums' fp32 additions into other tokens,
    as a 1e-7 nudge to its embeddings does (docs/benchmarks-history.md, issue 25)."""
    if quantization.startswith("Q"):
        path, kwargs = str(tmp_path / "model.gguf"), {"tokenizer": tokenizer_dir}  # (the file's would cost seconds)
        write_gguf(llama_dir, path, quantization, None)
    else:
        path, kwargs = llama_dir, {"quantization": quantization}
    args = dict(dtype=dtype, max_model_len=256, kv_cache_memory="16MiB", **kwargs)
    prompts = prompts_of_mixed_lengths(49152)
    llm = LLM(path, tensor_parallel_size=2, **args)
    assert _greedy(llm, prompts) == _greedy(LLM(path, **args), prompts)
    llm.engine.shutdown()


def test_quantized_shares_must_be_whole_groups(llama_dir):
    # o_proj's input: 2 heads of 16 a rank, not whole groups of 128
    with pytest.raises(ValueError, match="groups of 128 input values; rank 0's o_proj columns 0..32"):
        LLM(llama_dir, quantization="int4", tensor_parallel_size=2)
    q4_k = GGUFTensor("Q4_K", torch.zeros(16, 2 * 144, dtype=torch.uint8), 512)  # two 256-value blocks a row
    assert columns_in_blocks(q4_k, 256, 256).raw.shape == (16, 144)
    with pytest.raises(ValueError, match="do not fall on whole Q4_K blocks of 256"):
        columns_in_blocks(q4_k, 0, 288)


@pytest.mark.skipif(cpu_ops() is None, reason="no C++ toolchain")
def test_shared_memory_collectives(monkeypatch):
    """Two ranks as two threads on one region: sums in rank order (the same bits on each rank),
    gathers in rank order, tensors larger than a slot in pieces, bf16 summed in fp32 and rounded once."""
    monkeypatch.setattr(parallel_state, "SHM_SLOT_BYTES", 256)  # 64 fp32 values a piece
    memory = shared_memory.SharedMemory(create=True, size=parallel_state.SharedRegion.bytes_for(2))
    try:
        regions = [parallel_state.SharedRegion(memory, rank, 2, cpu_ops()) for rank in range(2)]
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(3, 100, generator=g) for _ in range(2)]
        bf = [torch.randn(130, generator=g).bfloat16() for _ in range(2)]
        ys = [torch.randn(5, 30, generator=g) for _ in range(2)]  # rows of 120 bytes: 2 a piece
        results: dict = {}

        def rank_work(rank: int) -> None:
            region = regions[rank]
            summed = xs[rank].clone()
            region.all_reduce(summed)
            summed_bf = bf[rank].clone()
            region.all_reduce(summed_bf)
            results[rank] = (summed, summed_bf, region.all_gather_rows(ys[rank]))

        threads = [threading.Thread(target=rank_work, args=(rank,), daemon=True) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
            assert not thread.is_alive(), "a rank still waits for the other"
        for rank in range(2):
            summed, summed_bf, gathered = results[rank]
            assert torch.equal(summed, xs[0] + xs[1])
            assert torch.equal(summed_bf, (bf[0].float() + bf[1].float()).bfloat16())
            assert torch.equal(gathered, torch.stack(ys))
    finally:
        memory.close()
        memory.unlink()


def _ranks_of(pid: int) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(pid).children(recursive=True)
        if "pagedllm.executor.multiproc" in " ".join(p.cmdline())
    ]


@pytest.mark.slow
def test_a_rank_killed_mid_request_fails_the_stream_and_the_server_exits(llama_dir):
    """The server with -tp 2: a rank killed while a stream runs; the client gets the engine's error
    event within seconds, the server exits non-zero, and no rank process is left."""
    server = Server(
        llama_dir,
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        "--dtype",
        "float32",
        "-tp",
        "2",
        env={"PAGEDLLM_FAULT": "slow:20"},
    )  # 20 ms more a step: the stream stays open
    try:
        ranks = _ranks_of(server.process.pid)
        assert len(ranks) == 2
        events, elapsed = kill_mid_stream(server, ranks[1].kill)
        assert elapsed < 10
        assert events[-1] == "data: [DONE]" and "engine has stopped" in events[-2]
        assert server.process.wait(timeout=30) != 0
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive
    finally:
        server.stop()


@pytest.mark.slow
def test_sigterm_leaves_no_rank_behind(llama_dir):
    server = Server(llama_dir, "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--dtype", "float32", "-tp", "2")
    ranks = _ranks_of(server.process.pid)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert client.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 4
    server.stop()  # SIGTERM
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert len(ranks) == 2 and not alive
