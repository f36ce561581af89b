"""Linear layers with bf16 weights packed for oneDNN against F.linear on the plain weights, our
kernel that reads the packed weights (up to ROWS_KERNEL_MAX rows a call, more in chunks) against
sums in fp32, and the gate_up layer that applies SiLU-and-mul as it stores against the two steps."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_ops
from pagedllm.layers.activation import silu_and_mul_reference
from pagedllm.layers import linear
from pagedllm.layers.linear import ROWS_KERNEL_CHUNKS, ROWS_KERNEL_MAX, Linear, SiluAndMulLinear, can_pack


def _layer(in_features: int, out_features: int, dtype: torch.dtype, bias: bool, cls: type = Linear) -> Linear:
    torch.manual_seed(in_features * out_features)
    return cls(in_features, out_features, bias=bias).to(dtype)


@pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="no oneDNN here")
@pytest.mark.parametrize("rows", [ROWS_KERNEL_MAX + 1, ROWS_KERNEL_MAX + 300])
@pytest.mark.parametrize("out_features, in_features", [(7, 64), (576, 1536), (1030, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_matches_plain(rows, out_features, in_features, bias, monkeypatch):
    monkeypatch.setattr(linear, "ROWS_KERNEL_CHUNKS", False)  # past ROWS_KERNEL_MAX: oneDNN's GEMM
    layer = _layer(in_features, out_features, torch.bfloat16, bias)
    plain_weight = layer.weight.detach().clone()
    layer.pack()
    assert layer.weight.layout == torch._mkldnn  # packing took place
    x = torch.randn(rows, in_features).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, plain_weight, layer.bias), atol=0, rtol=0)


def _rows_kernel_built() -> bool:
    ops = cpu_ops()
    return ops is not None and ops.packed_linear_available() and can_pack(torch.zeros(1, dtype=torch.bfloat16))


@pytest.mark.skipif(not _rows_kernel_built(), reason="no AVX512-BF16 kernels or oneDNN here")
@pytest.mark.parametrize("rows", sorted({r for r in (1, 2, 3, 5, 8, 64, 301, ROWS_KERNEL_MAX) if r <= ROWS_KERNEL_MAX}
                                         | ({2 * ROWS_KERNEL_MAX + 3} if ROWS_KERNEL_CHUNKS else set())))
@pytest.mark.parametrize("out_features, in_features", [(7, 64), (576, 1536), (1030, 100), (128, 2816)])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_kernel_sums_in_fp32(rows, out_features, in_features, bias, monkeypatch):
    """Shapes that fill oneDNN's 64 x 32 blocks and shapes it pads, narrow layers whose rows the
    threads split; each sum within one bf16 step of the fp32 sum (a misread layout is off by
    far more)."""
    layer = _layer(in_features, out_features, torch.bfloat16, bias)
    weight = layer.weight.detach().float()
    layer.pack()
    assert layer._rows is not None  # oneDNN chose the layout the kernel reads
    x = torch.randn(rows, in_features).bfloat16()
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", None)  # our kernel, not oneDNN's GEMM
    expected = x.float() @ weight.T + (layer.bias.float() if bias else 0)
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=1e-5)


def test_float32_weights_stay_plain():
    layer = _layer(64, 16, torch.float32, True)
    layer.pack()
    assert layer.weight.layout == torch.strided
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_packing_a_tied_head_leaves_the_embedding_alone():
    embedding = torch.nn.Embedding(50, 64).bfloat16()
    head = Linear(64, 50, bias=False)
    head.weight = embedding.weight
    before = embedding.weight.detach().clone()
    head.pack()
    assert torch.equal(embedding.weight, before) and embedding.weight.layout == torch.strided
    x = torch.randn(2, 64).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(head(x), F.linear(x, before), atol=0, rtol=0)


@pytest.mark.skipif(not _rows_kernel_built(), reason="no AVX512-BF16 kernels or oneDNN here")
@pytest.mark.parametrize("rows", sorted({r for r in (1, 3, 5, 64, 301) if r <= ROWS_KERNEL_MAX}
                                         | ({2 * ROWS_KERNEL_MAX + 3} if ROWS_KERNEL_CHUNKS else set())))
@pytest.mark.parametrize("n, in_features", [(64, 64), (192, 100), (2816, 1024)])
def test_silu_and_mul_linear_stores_what_silu_and_mul_makes_of_the_plain_layer(rows, n, in_features):
    """Gate and up interleaved, the activation applied as the kernel stores: bit for bit the
    layer's own product (our kernel, same sums) followed by silu_and_mul."""
    fused = _layer(in_features, 2 * n, torch.bfloat16, False, SiluAndMulLinear)
    plain = _layer(in_features, 2 * n, torch.bfloat16, False)
    assert torch.equal(fused.weight, plain.weight)
    fused.pack()
    plain.pack()
    assert fused._interleaved and fused._rows is not None and plain._rows is not None
    x = (torch.randn(rows, in_features) * 2).bfloat16()
    with torch.inference_mode():
        expected = silu_and_mul_reference(plain(x))
        torch.testing.assert_close(fused(x), expected, atol=0, rtol=0)


@pytest.mark.skipif(not _rows_kernel_built(), reason="no AVX512-BF16 kernels or oneDNN here")
def test_silu_and_mul_linear_through_onednn_undoes_the_interleaving(monkeypatch):
    monkeypatch.setattr(linear, "ROWS_KERNEL_CHUNKS", False)  # past ROWS_KERNEL_MAX: oneDNN's GEMM
    layer = _layer(96, 2 * 128, torch.bfloat16, False, SiluAndMulLinear)
    plain_weight = layer.weight.detach().clone()
    layer.pack()
    assert layer._interleaved
    x = torch.randn(ROWS_KERNEL_MAX + 5, 96).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), silu_and_mul_reference(F.linear(x, plain_weight)), atol=0, rtol=0)


@pytest.mark.parametrize("n, dtype", [(40, torch.bfloat16), (64, torch.float32)])
def test_silu_and_mul_linear_not_interleaved_where_blocks_do_not_fit(n, dtype):
    """Half widths that are not whole 64-column blocks, and fp32 weights, stay in their order."""
    layer = _layer(64, 2 * n, dtype, False, SiluAndMulLinear)
    plain_weight = layer.weight.detach().clone()
    layer.pack()
    assert not layer._interleaved
    x = torch.randn(3, 64).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), silu_and_mul_reference(F.linear(x, plain_weight)))
