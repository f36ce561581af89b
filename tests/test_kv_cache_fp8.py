"""fp8 KV caches (--kv-cache-dtype fp8, fp8_e4m3, fp8_e5m2): the bytes written, the attention
kernels reading them, and the engine running on them."""

from __future__ import annotations

import pytest
import torch

from conftest import greedy_without_kernels, prompt_logprobs, prompts_of_mixed_lengths
from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import (
    AttentionMetadata,
    KVScales,
    from_cache,
    paged_attention_reference,
    rotary_and_write_kv,
    to_fp8,
    write_kv,
)
from pagedllm.layers.rotary import RopeTables
from test_paged_attention_kernel import _case

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
needs_kernels = pytest.mark.skipif(cpu_ops() is None, reason="no C++ toolchain")


def _kernel(q, k_cache, v_cache, meta, window, scales: KVScales) -> torch.Tensor:
    """The C++ kernel over every token (no prompt left to the caller)."""
    out = torch.empty_like(q)
    cpu_ops().paged_attention(
        out,
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        q.shape[-1] ** -0.5,
        window or 0,
        scales.k,
        scales.v,
    )
    return out


def _fp8_case(kind, dtype, scales: KVScales, **shape):
    # Decodes enough for walks over all KV heads at once, a whole prompt, a chunk on cached context.
    seq_lens = [1, 37, 200, 64, 9] + [150 + i for i in range(8)]
    query_lens = [1, 1, 200, 20, 9] + [1] * 8
    q, k, v, meta = _case(seq_lens, query_lens, block_size=16, dtype=dtype, **shape)
    # Values past e4m3's range at scale 1 (saturated), and small ones (its subnormals).
    return q, to_fp8(k * 60, kind, scales.k), to_fp8(v * 0.02, kind, scales.v), meta


@needs_kernels
@pytest.mark.parametrize("kind", FP8)
@pytest.mark.parametrize("scales", [KVScales(), KVScales(0.25, 2.0)])
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 8, 2), (128, 4, 4), (64, 3, 3)])
@pytest.mark.parametrize("window", [None, 5])
def test_bf16_kernels_on_fp8_match_them_on_the_widened_cache(kind, scales, head_dim, heads, kv_heads, window):
    """The walks widen fp8 rows in registers, in another order of dims than a bf16 cache's (sums
    rounded in another order): within a bf16 rounding of the results on a bf16 cache holding
    those values (value x scale, exact for a power of two)."""
    q, k8, v8, meta = _fp8_case(kind, torch.bfloat16, scales, head_dim=head_dim, heads=heads, kv_heads=kv_heads)
    got = _kernel(q, k8, v8, meta, window, scales)
    widened = _kernel(
        q, from_cache(k8, torch.bfloat16, scales.k), from_cache(v8, torch.bfloat16, scales.v), meta, window, KVScales()
    )
    torch.testing.assert_close(got, widened, atol=8e-3, rtol=8e-3)
    want = paged_attention_reference(q.float(), k8, v8, meta, head_dim**-0.5, window, scales)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@needs_kernels
@pytest.mark.parametrize("kind", FP8)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(32, 4, 2), (64, 5, 1), (128, 9, 3)])
def test_portable_kernel_on_fp8_matches_the_reference(kind, dtype, tol, head_dim, heads, kv_heads):
    """fp32 queries, and head sizes or groups the AVX-512 path does not take, read fp8 by the
    portable walk."""
    scales = KVScales(0.5, 0.3)
    q, k8, v8, meta = _fp8_case(kind, dtype, scales, head_dim=head_dim, heads=heads, kv_heads=kv_heads)
    got = _kernel(q, k8, v8, meta, None, scales)
    want = paged_attention_reference(q.float(), k8, v8, meta, head_dim**-0.5, None, scales)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", FP8)
def test_reference_reads_the_values_written(kind):
    """The pure-torch path (other devices) writes value / scale saturated to the format's range
    and reads it back times the scale."""
    k = torch.tensor([[[1.0, -3.0, 1e6, -1e6]]])
    v = torch.tensor([[[0.5, 2.0, 1e-9, 7.0]]])
    k_cache = torch.zeros(2, 2, 1, 4, dtype=kind)
    v_cache = torch.zeros_like(k_cache)
    write_kv(k_cache, v_cache, k, v, torch.tensor([3]), KVScales(0.5, 2.0))
    limit = torch.finfo(kind).max
    assert from_cache(k_cache, torch.float32, 0.5)[1, 1, 0].tolist() == [1.0, -3.0, limit * 0.5, -limit * 0.5]
    assert from_cache(v_cache, torch.float32, 2.0)[1, 1, 0].tolist() == [0.5, 2.0, 0.0, 7.0]
    assert not from_cache(k_cache, torch.float32, 1.0)[0].any()  # no other slot written


@needs_kernels
@pytest.mark.parametrize("kind", FP8)
@pytest.mark.parametrize("flush_denormal", [False, True])
def test_walk_reads_every_fp8_byte_as_its_value(kind, flush_denormal):
    """The walk widens fp8 bytes by their bits, the subnormals to fp32 subnormals: every finite
    byte of V comes back as its value x scale (a one-token context), and a K row of the smallest
    subnormals still scores, with torch.set_flush_denormal on as well (the walk clears
    denormals-are-zero for itself)."""
    kv_heads, d = 4, 64
    codes = torch.arange(256, dtype=torch.uint8)
    codes[~codes.view(kind).float().isfinite()] = 0  # NaNs (and e5m2's infinities): never written
    codes = codes.view(kind)
    scales = KVScales(1.0, 0.75)
    v_cache = torch.zeros(1, 16, kv_heads, d, dtype=kind)
    v_cache[0, 0] = codes.view(kv_heads, d)
    k_cache = torch.zeros(1, 16, kv_heads, d, dtype=kind)
    k_cache[0, 1] = torch.tensor(1, dtype=torch.uint8).view(kind)  # the smallest subnormal
    tables = torch.zeros(1, 1, dtype=torch.int32)
    q = torch.full((1, kv_heads, d), 1e4)
    outs = []
    if flush_denormal and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for length in (1, 2):
            meta = AttentionMetadata(
                torch.zeros(0, dtype=torch.long),
                tables,
                torch.tensor([0, 1], dtype=torch.int32),
                torch.tensor([length], dtype=torch.int32),
                [length],
                [1],
            )
            outs.append((_kernel(q, k_cache, v_cache, meta, None, scales), meta))
    finally:
        torch.set_flush_denormal(False)
    values = from_cache(v_cache, torch.float32, scales.v)[0, 0]
    torch.testing.assert_close(outs[0][0][0], values, rtol=1e-6, atol=0)
    want = paged_attention_reference(q, k_cache, v_cache, outs[1][1], d**-0.5, None, scales)
    torch.testing.assert_close(outs[1][0], want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(want, values, rtol=1e-2)  # the subnormal K row carries weight


@needs_kernels
@pytest.mark.parametrize("kind", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cache_write_gives_the_bytes_torch_writes(kind, dtype):
    """The C++ write (rotary, then K/V as fp8 of value / scale) and the pure-torch write of the
    same rotated K/V leave the same bytes, saturated values included."""
    g = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, d = 9, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g) * 300
    qkv[:, -1] = 1e6  # a V value past either format's range at scale 3
    qkv = qkv.to(dtype)
    angles = torch.rand(tokens, d // 2, generator=g) * 50
    rope = RopeTables(torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
    scales = KVScales(0.5, 3.0)
    caches = [torch.zeros(4, 4, kv_heads, d, dtype=kind) for _ in range(4)]
    slots = torch.tensor([15, 3, 4, 9, 0, 12, 1, 2, 7])
    _, k, v = rotary_and_write_kv(qkv, rope, caches[0], caches[1], slots, heads, scales)
    write_kv(caches[2], caches[3], k, v, slots, scales)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert caches[1].float().abs().max() == torch.finfo(kind).max  # saturated, not inf or NaN
    assert caches[0].float().isfinite().all() and caches[1].float().isfinite().all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_on_fp8_holds_more_tokens_and_stays_close(head64_llama, dtype):
    """The same memory holds twice the tokens (four times, against fp32); teacher-forced, the
    prompt's logprobs stay near those of the model's own dtype (prefill chunks of 48 tokens, so
    that later chunks read the fp8 cache)."""
    prompts = prompts_of_mixed_lengths(49152, seed=4)
    results = {}
    for cache in ("auto", "fp8", "fp8_e5m2"):
        llm = LLM(
            head64_llama,
            dtype=dtype,
            kv_cache_memory="8MiB",
            kv_cache_dtype=cache,
            max_num_batched_tokens=48,
            enable_prefix_caching=False,
        )
        results[cache] = (llm.engine.model_runner.kv_caches[0][0].shape[0], prompt_logprobs(llm, prompts))
        llm.engine.shutdown()
    blocks, want = results["auto"]
    # Measured (bf16): e4m3 mean 0.028, max 0.094 nats; e5m2 (2 mantissa bits) 0.057, 0.26; the
    # bf16 model against fp32: 0.0065, 0.025 (the prompts' mean logprob is -11).
    for cache, mean_bound, max_bound in (("fp8", 0.05, 0.2), ("fp8_e5m2", 0.1, 0.4)):
        fp8_blocks, got = results[cache]
        assert fp8_blocks == blocks * (2 if dtype == "bfloat16" else 4)
        diffs = [abs(a - b) for ours, theirs in zip(got, want) for a, b in zip(ours, theirs)]
        assert sum(diffs) / len(diffs) < mean_bound and max(diffs) < max_bound, (cache, max(diffs))
        assert max(diffs) > 0  # the cache's rounding shows: the fp8 values were read


def test_pure_torch_path_on_fp8_gives_the_same_greedy_tokens(tiny_models):
    """Without the C++ kernels (as on a GPU), an fp8 cache is written and read by torch: the same
    greedy tokens as the kernels' (fp32 model)."""
    path = tiny_models["qwen3"]
    prompts = prompts_of_mixed_lengths(49152, seed=8)
    args = dict(dtype="float32", kv_cache_memory="16MiB", block_size=4, kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(path, **args)
    ours = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    assert greedy_without_kernels(dict(model=path, **args), prompts, 6)[0] == ours


def test_parallel_samples_copy_fp8_blocks_on_write(tiny_models):
    """n = 2 forks both samples from the held prompt, whose partial last block each copies before
    writing (the runner's block copy on fp8 tensors): greedy, both equal one sample alone."""
    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory="4MiB", block_size=4, kv_cache_dtype="fp8")
    prompts = [{"prompt_token_ids": p} for p in prompts_of_mixed_lengths(49152, seed=9)]  # lengths 1, 5, 17, 40, 73
    alone = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    pairs = llm.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for one, two in zip(alone, pairs):
        assert [s.token_ids for s in two.outputs] == [one.outputs[0].token_ids] * 2
