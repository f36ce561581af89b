"""The streaming bf16 linear kernel against an fp32 product of the same bf16 values."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.linear import MAX_KERNEL_ROWS, _gemv, linear


@pytest.mark.skipif(_gemv() is None, reason="no AVX512-BF16 kernel on this machine")
@pytest.mark.parametrize("rows", [1, 3, MAX_KERNEL_ROWS])
@pytest.mark.parametrize("out_features, in_features", [(7, 64), (576, 1536), (1030, 96)])
def test_kernel_matches_fp32_product(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    got = linear(x, w, bias)
    want = (x.float() @ w.float().T + bias.float())
    # Only the final rounding to bf16 (8 bits of mantissa) separates them.
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=1 / 128)


def test_falls_back_to_torch_for_big_batches_and_fp32():
    x = torch.randn(MAX_KERNEL_ROWS + 1, 64).bfloat16()
    w = torch.randn(16, 64).bfloat16()
    torch.testing.assert_close(linear(x, w), torch.nn.functional.linear(x, w))
    x32, w32 = x.float(), w.float()
    torch.testing.assert_close(linear(x32, w32), torch.nn.functional.linear(x32, w32))
