"""Linear layers with bf16 weights packed for oneDNN against F.linear on the plain weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.linear import Linear, can_pack


def _layer(in_features: int, out_features: int, dtype: torch.dtype, bias: bool) -> Linear:
    torch.manual_seed(in_features * out_features)
    return Linear(in_features, out_features, bias=bias).to(dtype)


@pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="no oneDNN here")
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 300])
@pytest.mark.parametrize("out_features, in_features", [(7, 64), (576, 1536), (1030, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_matches_plain(rows, out_features, in_features, bias):
    layer = _layer(in_features, out_features, torch.bfloat16, bias)
    plain_weight = layer.weight.detach().clone()
    layer.pack()
    assert layer.weight.layout == torch._mkldnn  # packing took place
    x = torch.randn(rows, in_features).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, plain_weight, layer.bias), atol=0, rtol=0)


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
