"""Linear layers with bf16 weights packed for oneDNN against F.linear on the plain weights, our
kernel that reads the packed weights (up to ROWS_KERNEL_MAX rows a call, more in chunks) against
sums in fp32, and the gate_up layer that applies SiLU-and-mul as it stores against the two steps;
each linear method, its checkpoint shards loaded in another order than the layer's, against
F.linear on the whole matrix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_ops
from pagedllm.layers import linear
from pagedllm.layers.activation import silu_and_mul_reference
from pagedllm.layers.linear import (
    ROWS_KERNEL_CHUNKS,
    ROWS_KERNEL_MAX,
    BlockedLinearMethod,
    Linear,
    LinearMethodBase,
    PackedBF16LinearMethod,
    QKVLinear,
    SiluAndMulLinear,
    UnquantizedLinearMethod,
    can_pack,
    rows_kernel_reads_onednn_layout,
)


def _layer(in_features: int, out_features: int, dtype: torch.dtype, bias: bool, cls: type = Linear) -> Linear:
    torch.manual_seed(in_features * out_features)
    return cls(in_features, out_features, bias=bias).to(dtype)


def _packed_for_onednn() -> bool:
    """Whether bf16 layers keep oneDNN's packed weights: where oneDNN packs bf16, unless the kernels
    are built and the rows kernel cannot read that layout (an AVX2 build; oneDNN's AMX layout),
    which gives them the blocked kernel instead."""
    return can_pack(torch.zeros(1, dtype=torch.bfloat16)) and (cpu_ops() is None or rows_kernel_reads_onednn_layout())


@pytest.mark.skipif(not _packed_for_onednn(), reason="no oneDNN, or an AVX2 build or AMX layout here")
@pytest.mark.parametrize("rows", [ROWS_KERNEL_MAX + 1, ROWS_KERNEL_MAX + 300])
@pytest.mark.parametrize("out_features, in_features", [(7, 64), (576, 1536), (1030, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_matches_plain(rows, out_features, in_features, bias, monkeypatch):
    monkeypatch.setattr(linear, "ROWS_KERNEL_CHUNKS", False)  # past ROWS_KERNEL_MAX: oneDNN's GEMM
    layer = _layer(in_features, out_features, torch.bfloat16, bias)
    plain_weight = layer.weight.detach().clone()
    layer.process_weights_after_loading()
    assert layer.weight.layout == torch._mkldnn  # packing took place
    x = torch.randn(rows, in_features).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, plain_weight, layer.bias), atol=0, rtol=0)


NO_ROWS_KERNEL = "no AVX512-BF16 kernels, no oneDNN, or a layout they do not read here"


def _rows_kernel_built() -> bool:
    """Whether bf16 layers run our rows kernel on oneDNN's packed weights here."""
    return cpu_ops() is not None and rows_kernel_reads_onednn_layout()


@pytest.mark.skipif(not _rows_kernel_built(), reason=NO_ROWS_KERNEL)
@pytest.mark.parametrize(
    "rows",
    sorted(
        {r for r in (1, 2, 3, 5, 8, 64, 301, ROWS_KERNEL_MAX) if r <= ROWS_KERNEL_MAX}
        | ({2 * ROWS_KERNEL_MAX + 3} if ROWS_KERNEL_CHUNKS else set())
    ),
)
@pytest.mark.parametrize("out_features, in_features", [(7, 64), (576, 1536), (1030, 100), (128, 2816)])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_kernel_sums_in_fp32(rows, out_features, in_features, bias, monkeypatch):
    """Shapes that fill oneDNN's 64 x 32 blocks and shapes it pads, narrow layers whose rows the
    threads split; each sum within one bf16 step of the fp32 sum (a misread layout is off by
    far more)."""
    layer = _layer(in_features, out_features, torch.bfloat16, bias)
    weight = layer.weight.detach().float()
    layer.process_weights_after_loading()
    assert layer._rows is not None  # oneDNN chose the layout the kernel reads
    x = torch.randn(rows, in_features).bfloat16()
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", None)  # our kernel, not oneDNN's GEMM
    expected = x.float() @ weight.T + (layer.bias.float() if bias else 0)
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=1e-5)


@pytest.mark.skipif(cpu_ops() is None, reason="the blocked kernel is C++")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features, in_features", [(16, 64), (200, 96), (1030, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_blocked_weights_sum_each_row_alike(out_features, in_features, bias, dtype):
    """The 16-column blocked kernel (fp32 everywhere; bf16 without AVX512-BF16, taken here
    whatever the CPU): each output within its fp32 sum's rounding of the fp64 sum (and, in bf16, one
    rounding of the result), and a row's output bit for bit the same whatever rows share its call
    (F.linear's GEMM is not: in fp32, 1, 2, 3 and 7 rows differ)."""
    layer = _layer(in_features, out_features, dtype, bias)
    plain_weight, plain_bias = layer.weight.detach().clone(), layer.bias
    layer.method = BlockedLinearMethod()
    layer.process_weights_after_loading()
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(out_features)).to(dtype)
    got = layer(x)
    assert got.dtype == dtype
    want = F.linear(x.double(), plain_weight.double(), None if plain_bias is None else plain_bias.double())
    tolerance = (x.double().abs() @ plain_weight.double().abs().T) * in_features * 2.0**-24 + 1e-30
    tolerance += 0 if plain_bias is None else 2.0**-23
    if dtype == torch.bfloat16:
        tolerance += want.abs() * 2.0**-8
    assert ((got.double() - want).abs() <= tolerance).all()
    alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
    for rows in (1, 2, 3, 5, 7, 9, 40):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    assert torch.equal(got[:40], alone)
    assert torch.equal(layer(x[None, :7])[0], alone[:7])  # leading dims flattened


def test_packing_a_tied_head_leaves_the_embedding_alone():
    embedding = torch.nn.Embedding(50, 64).bfloat16()
    head = Linear(64, 50, bias=False)
    head.weight = embedding.weight
    before = embedding.weight.detach().clone()
    head.process_weights_after_loading()
    assert torch.equal(embedding.weight, before) and embedding.weight.layout == torch.strided
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():  # (the head's kernel may sum in another order than F.linear)
        torch.testing.assert_close(head(x), F.linear(x, before))


@pytest.mark.skipif(not _rows_kernel_built(), reason=NO_ROWS_KERNEL)
@pytest.mark.parametrize(
    "rows",
    sorted(
        {r for r in (1, 3, 5, 64, 301) if r <= ROWS_KERNEL_MAX}
        | ({2 * ROWS_KERNEL_MAX + 3} if ROWS_KERNEL_CHUNKS else set())
    ),
)
@pytest.mark.parametrize("n, in_features", [(64, 64), (192, 100), (2816, 1024)])
def test_silu_and_mul_linear_stores_what_silu_and_mul_makes_of_the_plain_layer(rows, n, in_features):
    """Gate and up interleaved, the activation applied as the kernel stores: bit for bit the
    layer's own product (our kernel, same sums) followed by silu_and_mul."""
    fused = _layer(in_features, 2 * n, torch.bfloat16, False, SiluAndMulLinear)
    plain = _layer(in_features, 2 * n, torch.bfloat16, False)
    assert torch.equal(fused.weight, plain.weight)
    fused.process_weights_after_loading()
    plain.process_weights_after_loading()
    assert fused._interleaved and fused._rows is not None and plain._rows is not None
    x = (torch.randn(rows, in_features) * 2).bfloat16()
    with torch.inference_mode():
        expected = silu_and_mul_reference(plain(x))
        torch.testing.assert_close(fused(x), expected, atol=0, rtol=0)


@pytest.mark.skipif(not _rows_kernel_built(), reason=NO_ROWS_KERNEL)
def test_silu_and_mul_linear_through_onednn_undoes_the_interleaving(monkeypatch):
    monkeypatch.setattr(linear, "ROWS_KERNEL_CHUNKS", False)  # past ROWS_KERNEL_MAX: oneDNN's GEMM
    layer = _layer(96, 2 * 128, torch.bfloat16, False, SiluAndMulLinear)
    plain_weight = layer.weight.detach().clone()
    layer.process_weights_after_loading()
    assert layer._interleaved
    x = torch.randn(ROWS_KERNEL_MAX + 5, 96).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), silu_and_mul_reference(F.linear(x, plain_weight)), atol=0, rtol=0)


@pytest.mark.parametrize("n, dtype", [(40, torch.bfloat16), (64, torch.float32)])
def test_silu_and_mul_linear_not_interleaved_where_blocks_do_not_fit(n, dtype):
    """Half widths that are not whole 64-column blocks, and fp32 weights, stay in their order."""
    layer = _layer(64, 2 * n, dtype, False, SiluAndMulLinear)
    plain_weight = layer.weight.detach().clone()
    layer.process_weights_after_loading()
    assert not layer._interleaved
    x = torch.randn(3, 64).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), silu_and_mul_reference(F.linear(x, plain_weight)))


class _Uint8Method(LinearMethodBase):
    """A stand-in for a quantized format: its own uint8 parameter (w + 128), no decoder-stack kernel."""

    def create_weights(self, layer: Linear, weight_loader) -> None:
        layer.qweight = nn.Parameter(
            torch.empty(layer.out_features, layer.in_features, dtype=torch.uint8), requires_grad=False
        )
        layer.qweight.weight_loader = weight_loader

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.qweight.to(x.dtype) - 128, layer.bias)


_bf16_packs = can_pack(torch.zeros(1, dtype=torch.bfloat16))
# (the method a layer is built with, the weights' dtype, the method that serves them once loaded)
_METHODS = [
    (UnquantizedLinearMethod, torch.float32, BlockedLinearMethod if cpu_ops() else UnquantizedLinearMethod),
    (
        UnquantizedLinearMethod,
        torch.bfloat16,
        # (oneDNN's layout where our rows kernel reads it, or where no kernels of ours are built)
        PackedBF16LinearMethod
        if _rows_kernel_built() or (_bf16_packs and cpu_ops() is None)
        else BlockedLinearMethod
        if cpu_ops()
        else UnquantizedLinearMethod,
    ),
]


@pytest.mark.parametrize("method, dtype, serving", _METHODS)
def test_qkv_shards_loaded_v_q_k_give_f_linear_of_q_k_v(method, dtype, serving):
    torch.manual_seed(0)
    weights = {name: torch.randn(rows, 96).to(dtype) for name, rows in (("q", 128), ("k", 64), ("v", 64))}
    biases = {name: torch.randn(len(w)).to(dtype) for name, w in weights.items()}
    layer = QKVLinear(96, 128, 64, bias=True, method=method()).to(dtype)
    for shard in ("v", "q", "k"):
        layer.weight.weight_loader(layer.weight, weights[shard], shard)
        layer.bias.weight_loader(layer.bias, biases[shard], shard)
    layer.process_weights_after_loading()
    assert type(layer.method) is serving
    x = torch.randn(5, 96).to(dtype)
    expected = F.linear(x, torch.cat(list(weights.values())), torch.cat(list(biases.values())))
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), expected)  # bf16: the rows kernel sums in its own order


@pytest.mark.parametrize("method, dtype, serving", _METHODS)
def test_gate_up_shards_loaded_up_first_give_silu_and_mul_of_f_linear(method, dtype, serving):
    torch.manual_seed(1)
    gate, up = (torch.randn(128, 96).to(dtype) for _ in range(2))
    layer = SiluAndMulLinear(96, 256, bias=False, method=method()).to(dtype)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.process_weights_after_loading()
    assert type(layer.method) is serving
    assert layer._interleaved == (serving is PackedBF16LinearMethod and _rows_kernel_built())
    x = torch.randn(5, 96).to(dtype)
    with torch.inference_mode():  # (our kernels sum in their own order: fp32 within 96 roundings)
        want = silu_and_mul_reference(F.linear(x, torch.cat([gate, up])))
        torch.testing.assert_close(layer(x), want, **({"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {}))


def test_a_method_owns_parameters_of_its_own_dtype_and_shape():
    """The layer's shard loader fills a uint8 parameter by rows; the model's dtype leaves it alone."""
    torch.manual_seed(2)
    shards = {
        name: torch.randint(0, 256, (rows, 32), dtype=torch.uint8) for name, rows in (("q", 64), ("k", 32), ("v", 32))
    }
    layer = QKVLinear(32, 64, 32, bias=False, method=_Uint8Method()).to(torch.bfloat16)
    assert layer.qweight.dtype == torch.uint8 and not hasattr(layer, "weight")
    for shard in ("k", "v", "q"):
        layer.qweight.weight_loader(layer.qweight, shards[shard], shard)
    layer.process_weights_after_loading()
    x = torch.randn(3, 32).bfloat16()
    expected = F.linear(x, torch.cat(list(shards.values())).bfloat16() - 128)
    torch.testing.assert_close(layer(x), expected, atol=0, rtol=0)
    assert layer.kernel_spec() is None


def test_a_shard_of_the_wrong_shape_is_refused():
    layer = QKVLinear(32, 64, 32, bias=False)
    with pytest.raises(ValueError, match=r"checkpoint shape \(64, 32\), model expects \(32, 32\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(64, 32), "k")
