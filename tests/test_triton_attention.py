"""The GPU path's Triton paged attention (kernels/triton_attention.py), run on the CPU under Triton's
interpreter, against the torch reference the C++ kernel is held to: decode rows and prefill chunks
over cached prefixes in one step, grouped-query heads, sliding windows, soft-capped scores and
attention sinks, a head size that is not a power of two."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from pagedllm.layers.attention import BACKEND_ENV, paged_attention_reference

# Triton decides at its own import whether @triton.jit interprets (its library's functions too), so
# the kernel's checks run in a process of their own, started with TRITON_INTERPRET=1 by the first test.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_the_interpreter = pytest.mark.skipif(not INTERPRETED, reason="run by test_kernels_under_the_interpreter's process")


def test_kernels_under_the_interpreter():
    if INTERPRETED:
        pytest.skip("this is that process")
    pytest.importorskip("triton")
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", __file__],
        # The engine's tests below take the GPU path's layers: torch ops and these kernels.
        env={**os.environ, "TRITON_INTERPRET": "1", "PAGEDLLM_NO_KERNELS": "1", BACKEND_ENV: "TRITON_ATTN"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and " failed" not in child.stdout, child.stdout[-2000:]


@pytest.fixture(scope="module")
def kernel():
    from pagedllm.kernels import triton_attention

    return triton_attention


def _step(seq_lens: list[int], query_lens: list[int], heads: int, kv_heads: int, head_dim: int, seed: int):
    """A step's q, caches (blocks of 8 handed out shuffled) and metadata, and the reference's view of them."""
    g = torch.Generator().manual_seed(seed)
    block_size = 8
    tables = []
    next_block = 0
    for seq_len in seq_lens:
        count = -(-seq_len // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    order = torch.randperm(next_block, generator=g).tolist()  # blocks anywhere in the cache
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([[order[b] for b in t] + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache = torch.randn(next_block, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(next_block, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = SimpleNamespace(seq_lens_list=seq_lens, query_lens_list=query_lens, block_tables=block_tables)
    return q, k_cache, v_cache, block_tables, starts, torch.tensor(seq_lens, dtype=torch.int32), meta


# A decode row, a prefill chunk over a cached prefix, a whole prompt, a decode deep in its sequence.
_SEQ_LENS, _QUERY_LENS = [9, 21, 6, 40], [1, 7, 6, 1]


@in_the_interpreter
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "window", "softcap", "sinks"),
    [
        (4, 2, 16, None, None, False),
        (4, 1, 24, None, None, False),  # head size padded to 32 lanes
        (2, 2, 16, 5, None, False),
        (4, 2, 16, None, 3.0, False),
        (4, 2, 16, 6, None, True),
    ],
)
def test_triton_attention_equals_the_reference(kernel, heads, kv_heads, head_dim, window, softcap, sinks):
    q, k_cache, v_cache, tables, starts, lens, meta = _step(_SEQ_LENS, _QUERY_LENS, heads, kv_heads, head_dim, seed=1)
    sink_logits = torch.randn(heads, generator=torch.Generator().manual_seed(2)) if sinks else None
    scale = head_dim**-0.5
    out = kernel.paged_attention(q, k_cache, v_cache, tables, starts, lens, scale, window, softcap, sink_logits)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, scale, window, softcap=softcap, sinks=sink_logits)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@in_the_interpreter
def test_triton_attention_reads_its_own_sequence(kernel):
    """Swapping two sequences' block tables changes only their rows: a kernel reading the wrong
    table, position or KV head would not pass the test above by chance, and this one says which."""
    q, k_cache, v_cache, tables, starts, lens, meta = _step([16, 16], [1, 1], 2, 1, 16, seed=3)
    out = kernel.paged_attention(q, k_cache, v_cache, tables, starts, lens, 0.25)
    swapped = kernel.paged_attention(q, k_cache, v_cache, tables.flip(0).contiguous(), starts, lens, 0.25)
    assert not torch.allclose(out, swapped)
    meta.block_tables = tables.flip(0)
    torch.testing.assert_close(swapped, paged_attention_reference(q, k_cache, v_cache, meta, 0.25, None))


@in_the_interpreter
def test_triton_attention_refuses_mismatched_shapes(kernel):
    q, k_cache, v_cache, tables, starts, lens, _ = _step([4], [4], 4, 2, 16, seed=4)
    with pytest.raises(ValueError, match="does not fit"):
        kernel.paged_attention(q[..., :8], k_cache, v_cache, tables, starts, lens, 0.25)


@in_the_interpreter
def test_triton_attention_in_bf16(kernel):
    """bf16 queries and caches (the GPU's dtype): fp32 inside, one rounding at the store, so within
    a bf16 step of the reference computed in fp32 on the same values."""
    q, k_cache, v_cache, tables, starts, lens, meta = _step(_SEQ_LENS, _QUERY_LENS, 4, 2, 16, seed=5)
    q, k_cache, v_cache = (t.bfloat16() for t in (q, k_cache, v_cache))
    out = kernel.paged_attention(q, k_cache, v_cache, tables, starts, lens, 0.25)
    expected = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.25, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=2**-7)


@in_the_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kv_write_equals_the_torch_write(kernel, dtype):
    """Tokens' K and V (3 KV heads, head size 24: both padded) into scattered slots of a cache of
    their dtype (the GPU's bf16 too), as the torch path writes them; the other slots untouched."""
    from pagedllm.layers.attention import write_kv

    g = torch.Generator().manual_seed(6)
    k, v = (torch.randn(5, 3, 24, generator=g).to(dtype) for _ in range(2))
    slots = torch.tensor([17, 3, 30, 8, 0])
    k_cache, v_cache = (torch.randn(4, 8, 3, 24, generator=g).to(dtype) for _ in range(2))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv(expected_k, expected_v, k, v, slots)
    kernel.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@in_the_interpreter
@pytest.mark.parametrize(
    ("window", "softcap", "sinks"), [(None, None, False), (70, None, False), (None, 3.0, False), (None, None, True)]
)
def test_a_split_context_equals_the_reference(kernel, monkeypatch, window, softcap, sinks):
    """Contexts longer than a partition (32 keys here) are split and folded: decode rows over 4 and
    5 partitions (some of which a window leaves out), and a prefill chunk's rows beside them (a
    step this small splits them too)."""
    monkeypatch.setattr(kernel, "PARTITION", 32)
    seq_lens, query_lens = [150, 97, 40], [1, 1, 5]
    q, k_cache, v_cache, tables, starts, lens, meta = _step(seq_lens, query_lens, 4, 2, 16, seed=7)
    sink_logits = torch.randn(4, generator=torch.Generator().manual_seed(8)) if sinks else None
    out = kernel.paged_attention(q, k_cache, v_cache, tables, starts, lens, 0.25, window, softcap, sink_logits)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, 0.25, window, softcap=softcap, sinks=sink_logits)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@in_the_interpreter
@pytest.mark.parametrize(("window", "sinks"), [(None, False), (20, True)])
def test_a_tokens_output_has_the_same_bits_split_or_not(kernel, monkeypatch, window, sinks):
    """Whether a step splits, and into how many partitions, comes from its tensors' shapes alone
    (a captured graph replays it whatever the lengths); a token's output is the same bits either
    way, and whatever else the step holds: alone, beside a wider table, or among many tokens."""
    monkeypatch.setattr(kernel, "PARTITION", 16)
    sink_logits = torch.randn(4, generator=torch.Generator().manual_seed(13)) if sinks else None
    q, k_cache, v_cache, tables, starts, lens, _ = _step([50, 20], [1, 6], 4, 1, 16, seed=9)
    args = (0.25, window, None, sink_logits)
    split = kernel.paged_attention(q, k_cache, v_cache, tables, starts, lens, *args)
    wide = torch.nn.functional.pad(tables, (0, 6))  # more partitions, all empty
    assert torch.equal(kernel.paged_attention(q, k_cache, v_cache, wide, starts, lens, *args), split)
    monkeypatch.setattr(kernel, "SPLIT_MAX_TOKENS", 2)  # 7 tokens: whole
    assert torch.equal(kernel.paged_attention(q, k_cache, v_cache, tables, starts, lens, *args), split)
    monkeypatch.setattr(kernel, "SPLIT_MAX_TOKENS", 256)
    alone = kernel.paged_attention(q[:1], k_cache, v_cache, tables[:1], starts[:2], lens[:1], *args)
    assert torch.equal(alone, split[:1])


@in_the_interpreter
@pytest.mark.parametrize("kind", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_attention_on_fp8_caches(kernel, monkeypatch, kind, dtype):
    """fp8 caches with their scales, widened as the reference widens them (times the scale,
    rounded once to q's dtype); split and whole."""
    from pagedllm.layers.attention import KVScales, to_fp8

    q, k_cache, v_cache, tables, starts, lens, meta = _step(_SEQ_LENS, _QUERY_LENS, 4, 2, 16, seed=10)
    scales = KVScales(k=0.05, v=0.002)
    k8, v8 = to_fp8(k_cache * 60, kind, scales.k), to_fp8(v_cache * 0.02, kind, scales.v)
    q = q.to(dtype)
    expected = paged_attention_reference(q, k8, v8, meta, 0.25, None, scales).float()
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    for partition in (512, 16):
        monkeypatch.setattr(kernel, "PARTITION", partition)
        out = kernel.paged_attention(q, k8, v8, tables, starts, lens, 0.25, k_scale=scales.k, v_scale=scales.v)
        torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@in_the_interpreter
def test_triton_attention_takes_the_engines_token_sequences(kernel):
    """Given each token's sequence (as the engine's metadata carries it, so that a captured graph
    makes no host synchronization), the same result as working it out."""
    q, k_cache, v_cache, tables, starts, lens, _ = _step(_SEQ_LENS, _QUERY_LENS, 4, 2, 16, seed=11)
    token_seq = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3])
    given = kernel.paged_attention(q, k_cache, v_cache, tables, starts, lens, 0.25, token_seq=token_seq)
    assert torch.equal(given, kernel.paged_attention(q, k_cache, v_cache, tables, starts, lens, 0.25))


@in_the_interpreter
@pytest.mark.parametrize("kind", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_fp8_write_equals_the_torch_write(kernel, kind):
    """fp8 bytes of value / scale, saturated, rounded to nearest even: the bytes the torch path (and
    the C++ kernels) write."""
    from pagedllm.layers.attention import KVScales, write_kv

    g = torch.Generator().manual_seed(12)
    k, v = torch.randn(5, 3, 24, generator=g) * 900, torch.randn(5, 3, 24, generator=g) * 0.01
    slots = torch.tensor([17, 3, 30, 8, 0])
    k_cache, v_cache = (torch.randn(4, 8, 3, 24, generator=g).to(kind) for _ in range(2))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv(expected_k, expected_v, k, v, slots, KVScales(2.0, 0.001))
    kernel.write_kv(k_cache, v_cache, k, v, slots, 2.0, 0.001)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))


@in_the_interpreter
@pytest.mark.parametrize("kind", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_fp8_rounding_at_every_tie(kind, kernel):
    """Every finite fp8 value, every midpoint between neighbours (ties to even, a carry into the
    next exponent among them) and values past the largest: the bytes torch's conversion gives."""
    values = torch.arange(256, dtype=torch.uint8).view(kind).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    largest = values.max().item()
    x = torch.cat([values, mids, torch.tensor([largest * 1.01, -largest * 4, 1e-9, -1e-9])])
    x = torch.nn.functional.pad(x, (0, -x.numel() % 8)).view(-1, 1, 8)
    slots = torch.arange(x.shape[0])
    k_cache = torch.zeros(x.shape[0], 1, 1, 8, dtype=kind)
    v_cache = torch.zeros_like(k_cache)
    kernel.write_kv(k_cache, v_cache, x, x, slots)
    expected = x.clamp(-largest, largest).to(kind).view(torch.uint8)
    assert torch.equal(k_cache.view(torch.uint8).view(-1), expected.view(-1))


@in_the_interpreter
def test_the_engine_on_the_triton_kernels_matches_transformers(tiny_models, kernel, monkeypatch):
    """The engine with the GPU path's layers (torch ops, these kernels for attention and the cache
    write), partitions of 16 keys so that decode rows split: greedy tokens equal transformers',
    logprobs within fp32 tolerance, on Mistral's grouped heads and sliding window. (Each kernel
    launch costs the interpreter a second or so: one model here, the kernels' own cases above.)"""
    from test_model_correctness import assert_matches_transformers

    monkeypatch.setattr(kernel, "PARTITION", 16)
    calls = []
    attend, write = kernel.paged_attention, kernel.write_kv
    monkeypatch.setattr(kernel, "paged_attention", lambda *a, **k: calls.append("attend") or attend(*a, **k))
    monkeypatch.setattr(kernel, "write_kv", lambda *a, **k: calls.append("write") or write(*a, **k))
    assert_matches_transformers(tiny_models["mistral"])
    assert {"attend", "write"} <= set(calls)


@in_the_interpreter
def test_the_engine_on_the_triton_kernels_is_batch_and_cache_invariant(tiny_models, kernel, monkeypatch):
    """Greedy tokens alone and in a batch, with a prefix cached or not (the second prompt extends the
    first), on an fp8 KV cache (the bf16/fp32 caches' batch above): the same."""
    from pagedllm import LLM, SamplingParams

    monkeypatch.setattr(kernel, "PARTITION", 16)
    prompts = [list(range(3, 60)), list(range(3, 60)) + [7, 8], list(range(100, 105))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(tiny_models["qwen3"], dtype="float32", block_size=4, kv_cache_memory="16MiB", kv_cache_dtype="fp8")
    alone = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch] == alone


def _compile_for_h100(jit, types: dict[str, str], constants: dict) -> str:
    """The kernel compiled by Triton for an sm_90 GPU (front end, LLVM, ptxas: no GPU needed)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = inspect.signature(jit.fn).parameters
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    source = ASTSource(jit, signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    return compiled.asm["ptx"]


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's functions are not compiled")
@pytest.mark.parametrize(("cache", "fp8"), [("fp32", 0), ("bf16", 0), ("u8", 1), ("u8", 2)])
@pytest.mark.parametrize("split", [False, True])
def test_the_kernels_compile_for_a_gpu(cache, fp8, split):
    """The interpreter runs Python, not Triton's compiler: every variant the engine launches goes
    through the compiler here (types across branches, constexprs, fp8 conversions), so that a lent
    GPU's minutes are not the first to see them."""
    pytest.importorskip("triton")
    from pagedllm.kernels import triton_attention as kernel

    q = "fp32" if cache == "fp32" else "bf16"
    pointers = dict(out_ptr=q, q_ptr=q, k_cache_ptr=cache, v_cache_ptr=cache, sinks_ptr="fp32", token_seq_ptr="i64")
    pointers |= dict(part_max_ptr="fp32", part_sum_ptr="fp32", part_acc_ptr="fp32", block_tables_ptr="i32")
    pointers |= dict(query_start_loc_ptr="i32", seq_lens_ptr="i32", k_ptr=q, v_ptr=q, slots_ptr="i64")
    types = {name: "*" + t for name, t in pointers.items()}
    types |= dict.fromkeys(["scale", "k_scale", "v_scale", "softcap"], "fp32")
    constants = dict(GROUP=4, BLOCK_G=16, BLOCK_SIZE=16, HEAD_DIM=80, BLOCK_D=128, PARTITION=512, TILE=16)
    constants |= dict(SPLIT=split, HAS_SOFTCAP=split, HAS_SINKS=not split, FP8=fp8)
    assert ".entry _attention" in _compile_for_h100(kernel._attention, types, constants)
    write = dict(KV_HEADS=3, HEAD_DIM=80, BLOCK_SIZE=16, BLOCK_H=4, BLOCK_D=128, FP8=fp8)
    assert ".entry _write_kv" in _compile_for_h100(kernel._write_kv, types, write)
    if split:
        fold = dict(HEAD_DIM=80, BLOCK_D=128, HAS_SINKS=True)
        assert ".entry _fold_partitions" in _compile_for_h100(kernel._fold_partitions, types, fold)
