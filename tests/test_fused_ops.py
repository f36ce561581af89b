"""The fused C++ elementwise kernels against their torch references (same rounding points)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu_ops
from pagedllm.layers.activation import silu_and_mul, silu_and_mul_reference
from pagedllm.layers.attention import rotary_and_write_kv
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm, gemma_rms_norm_reference, rms_norm_reference
from pagedllm.layers.rotary import RopeTables, apply_rotary

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="no C++ toolchain")
# bfloat16 results must be identical; float32 may differ by fused multiply-adds.
TOLERANCE = {torch.bfloat16: dict(atol=0, rtol=0), torch.float32: dict(atol=1e-6, rtol=1e-6)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_and_residual_add(dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    x = (torch.randn(5, 96, generator=g) * 3).to(dtype)
    delta = torch.randn(5, 96, generator=g).to(dtype)
    torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, norm.eps), **TOLERANCE[dtype])
    residual, normed = norm.add_and_norm(x.clone(), delta)
    torch.testing.assert_close(residual, x + delta, **TOLERANCE[dtype])
    torch.testing.assert_close(normed, rms_norm_reference(x + delta, norm.weight, norm.eps), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemma_rms_norm(dtype):
    """Gemma's (1 + weight) RMSNorm, scaled in fp32 and rounded once, on rows of Gemma 3 270M's
    width and on q/k heads."""
    g = torch.Generator().manual_seed(3)
    for size, rows in ((640, 5), (256, 12)):
        norm = GemmaRMSNorm(size, 1e-6)
        norm.weight.data = (torch.randn(size, generator=g) * 0.5).to(dtype)
        x = (torch.randn(rows, size, generator=g) * 3).to(dtype)
        torch.testing.assert_close(norm(x), gemma_rms_norm_reference(x, norm.weight, norm.eps), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul(dtype):
    x = (torch.randn(7, 2 * 80, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_and_cache_write_on_qkv_rows(dtype):
    g = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, d, block_size = 6, 6, 2, 16, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    angles = torch.rand(tokens, d // 2, generator=g) * 50
    rope = RopeTables(torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
    q_ref, k_ref, v_ref = qkv.clone().split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_ref = apply_rotary(q_ref.reshape(tokens, heads, d), rope)
    k_ref = apply_rotary(k_ref.reshape(tokens, kv_heads, d), rope)
    k_cache = torch.zeros(5, block_size, kv_heads, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([17, 3, 4, 9, 0, 12])
    q, k, v = rotary_and_write_kv(qkv, rope, k_cache, v_cache, slots, heads)
    torch.testing.assert_close(q, q_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(k, k_ref, **TOLERANCE[dtype])
    assert q.data_ptr() == qkv.data_ptr()  # rotated in place, no copies
    flat_k, flat_v = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    torch.testing.assert_close(flat_k[slots], k_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(flat_v[slots], v_ref.reshape(tokens, kv_heads, d), atol=0, rtol=0)
    others = torch.ones(flat_k.shape[0], dtype=torch.bool)
    others[slots] = False
    assert not flat_k[others].any() and not flat_v[others].any()  # no other slot written
