"""The fused C++ elementwise kernels against their torch references (same rounding points)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu_ops
from pagedllm.layers.activation import silu_and_mul, silu_and_mul_reference
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RopeTables, apply_rotary, apply_rotary_reference

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
    torch.testing.assert_close(norm(x), norm.reference(x), **TOLERANCE[dtype])
    residual, normed = norm.add_and_norm(x.clone(), delta)
    torch.testing.assert_close(residual, x + delta, **TOLERANCE[dtype])
    torch.testing.assert_close(normed, norm.reference(x + delta), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul(dtype):
    x = (torch.randn(7, 2 * 80, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_in_place_on_a_qkv_view(dtype):
    g = torch.Generator().manual_seed(2)
    tokens, heads, d = 6, 3, 16
    qkv = torch.randn(tokens, heads * d + 8, generator=g).to(dtype)  # q, then something else
    angles = torch.rand(tokens, d // 2, generator=g) * 50
    rope = RopeTables(torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
    q = qkv[:, : heads * d].view(tokens, heads, d)
    expected = apply_rotary_reference(q.clone(), rope)
    tail = qkv[:, heads * d:].clone()
    got = apply_rotary(q, rope)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    assert got.data_ptr() == q.data_ptr() and torch.equal(qkv[:, heads * d:], tail)
