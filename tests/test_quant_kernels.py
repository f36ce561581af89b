"""Quantized weights: GGUF blocks decoded exactly (against the gguf package's own dequantizer), and
the C++ kernels (their vector path, AVX512-VNNI or AVX2, and the portable one) against the pure-torch
reference, dequantize-then-matmul."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gguf_writer import random_blocks
from pagedllm.kernels import cpu_ops
from pagedllm.layers.quantization import formats
from pagedllm.layers.quantization.formats import FORMATS, decode, dequantize, pack, quantize_activations

ops = cpu_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason="C++ kernels unavailable")
PATHS = [False, True] if ops is not None and ops.quant_linear_simd() else [True]


def fields_of(name: str, rows: int, cols: int, seed: int = 0) -> formats.Fields:
    return decode(random_blocks(name, rows, cols, 3e-3, seed), FORMATS[name])


def cols_for(name: str, count: int) -> int:
    return FORMATS[name].record_values * count


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_decode_equals_the_gguf_package(name):
    raw = random_blocks(name, 21, cols_for(name, 3), 3e-3)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    assert torch.equal(dequantize(decode(raw, FORMATS[name])), torch.from_numpy(expected.astype(np.float32)))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_decode_of_quantized_floats(name):
    """Blocks from gguf's own quantizer (not random bits): the round trip is gguf's."""
    w = np.random.default_rng(1).standard_normal((9, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[name])
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    assert torch.equal(dequantize(decode(raw, FORMATS[name])), torch.from_numpy(expected))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_record_size(name):
    fmt = FORMATS[name]
    assert pack(fields_of(name, 40, cols_for(name, 2))).shape == (
        3,
        2 * fmt.record_values // fmt.record_values,
        fmt.record_bytes,
    )
    # The same bits a weight as the file, give or take the 16-row padding and the K types' scales,
    # but where the records spend more: Q3_K's 6-bit sub-scales a byte each, MXFP4's
    # exponent byte as a float32, IQ3_S's grid points of 3.4 bits a value as 4-bit codes.
    file_bits = fmt.block_bytes * 8 / fmt.block_values
    more = {"Q3_K": 0.1875, "MXFP4": 0.75, "IQ3_S": 0.9375}.get(name, 0)
    assert fmt.record_bytes * 8 / (16 * fmt.record_values) == pytest.approx(file_bits + more, abs=0.126)
    if fmt.k_quant:  # K records end on a cache line, so that none starts mid-line; the padding is zeros
        assert fmt.record_bytes % 64 == 0
        packed = pack(fields_of(name, 40, cols_for(name, 2)))
        assert not packed[..., fmt.record_bytes - fmt.record_padding :].any()


@needs_kernels
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [32, 256])
def test_activations_quantize_as_the_reference(portable, dtype, block):
    cols = 3 * block
    x = (torch.randn(7, cols) * torch.logspace(-3, 2, cols)).to(dtype)
    x[3, block : 2 * block] = 0  # a block of zeros: scale 0, codes 0
    x[4, 5] = 2.5 * x[4, :block].abs().max() / 127  # (not a tie after scaling, but near the top)
    codes, scales, sums = ops.quantize_activations(x, portable, block)
    q, d = quantize_activations(x, block)
    assert d.shape == (7, 3)
    assert torch.equal(codes, q) and torch.equal(scales, d)
    assert torch.equal(sums, q.view(7, -1, 16).int().sum(-1))


def kernel_linear(fields: list[formats.Fields], x: torch.Tensor, bias=None, portable=False, silu_mul=False):
    segments = [(pack(f), f.format.format_id, f.shape[0]) for f in fields]
    return ops.QuantLinear(segments, x.shape[1], bias, silu_mul, portable)(x)


def assert_close_to_reference(out: torch.Tensor, x: torch.Tensor, fields: formats.Fields, bias=None) -> None:
    """Within float32's rounding of sums of (scaled) block products, taken against the sum of their
    magnitudes, and (bf16 output) one rounding to bf16."""
    xd = formats.quantized_activations(x, formats.activation_block(fields.format))
    w = dequantize(fields).double()
    expected, magnitude = xd @ w.T, xd.abs() @ w.abs().T
    if bias is not None:
        expected, magnitude = expected + bias.double(), magnitude + bias.double().abs()
    assert torch.allclose(expected, formats.reference_linear(x, fields) + (0 if bias is None else bias.double()))
    tolerance = magnitude * (x.shape[1] // 32 + 8) * 2.0**-22
    if out.dtype == torch.bfloat16:
        tolerance = tolerance + expected.abs() * 2.0**-8
    assert ((out.double() - expected).abs() <= tolerance).all(), (out.double() - expected).abs().max()


@needs_kernels
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 70])
def test_kernel_equals_the_reference(name, portable, rows):
    fields = fields_of(name, 40, cols_for(name, 3 if FORMATS[name].k_quant else 5), seed=rows)
    x = torch.randn(rows, fields.shape[1], generator=torch.Generator().manual_seed(rows))
    assert_close_to_reference(kernel_linear([fields], x, portable=portable), x, fields)


@needs_kernels
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_is_the_same_whatever_rows_share_its_call(name, dtype):
    """Batch invariance and speculative verification's exactness rest on it: a row's output, bit
    for bit, does not depend on how many rows its call has (a decode's 1, a verification's up to
    9, a prefill's hundreds: passes of several rows, one pass of 5-8 while weights stream from
    memory, two of 4 beyond, rows shared out among the threads) nor on where in the call it is."""
    fields = fields_of(name, 40, cols_for(name, 3 if FORMATS[name].k_quant else 5), seed=11)
    x = torch.randn(300, fields.shape[1], generator=torch.Generator().manual_seed(3)).to(dtype)
    alone = torch.cat([kernel_linear([fields], x[i : i + 1]) for i in range(300)])
    for rows in (2, 4, 5, 6, 7, 8, 9, 12, 33, 257, 300):
        assert torch.equal(kernel_linear([fields], x[:rows]), alone[:rows]), rows
    assert torch.equal(kernel_linear([fields], x[5:300]), alone[5:300])


@needs_kernels
@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("portable", PATHS)
def test_kernel_in_bf16_with_bias(name, portable):
    fields = fields_of(name, 33, cols_for(name, 2), seed=5)
    x = torch.randn(6, fields.shape[1]).bfloat16()
    bias = torch.randn(33).bfloat16()
    out = kernel_linear([fields], x, bias, portable)
    assert out.dtype == torch.bfloat16
    assert_close_to_reference(out, x, fields, bias)


@needs_kernels
@pytest.mark.parametrize("portable", PATHS)
def test_segments_of_different_types_fill_their_columns(portable):
    """A fused layer whose shards are of different types (q, k as Q4_K and v as Q6_K in a Q4_K_M
    file): each segment's rows land in its own columns, as if each were a layer alone."""
    cols = 256
    parts = [fields_of("Q4_K", 48, cols, 1), fields_of("Q4_K", 16, cols, 2), fields_of("Q6_K", 20, cols, 3)]
    x = torch.randn(3, cols)
    out = kernel_linear(parts, x, portable=portable)
    alone = torch.cat([kernel_linear([p], x, portable=portable) for p in parts], dim=1)
    assert torch.equal(out, alone)


@needs_kernels
def test_silu_mul_of_gate_and_up():
    gate, up = fields_of("Q8_0", 32, 64, 1), fields_of("Q8_0", 32, 64, 2)
    x = torch.randn(5, 64)
    both = kernel_linear([gate, up], x)
    fused = kernel_linear([gate, up], x, silu_mul=True)
    expected = torch.empty(5, 32)
    ops.silu_and_mul(expected, both)
    assert torch.equal(fused, expected)
    assert torch.allclose(fused, torch.nn.functional.silu(both[:, :32]) * both[:, 32:], rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_are_the_dequantized_rows(name, dtype):
    fields = fields_of(name, 37, cols_for(name, 2), seed=7)
    ids = torch.tensor([0, 36, 5, 5, 17, 16, 15])
    out = torch.empty(len(ids), fields.shape[1], dtype=dtype)
    ops.quant_embedding(out, ids, pack(fields), fields.format.format_id)
    assert torch.equal(out, dequantize(fields)[ids].to(dtype))


@needs_kernels
def test_bad_shapes_are_refused():
    fields = fields_of("Q4_0", 16, 64)
    with pytest.raises(RuntimeError, match="takes 96"):
        ops.QuantLinear([(pack(fields), 0, 16)], 96, None)
    with pytest.raises(RuntimeError, match="do not match format"):
        ops.QuantLinear([(pack(fields), 1, 16)], 64, None)
    layer = ops.QuantLinear([(pack(fields), 0, 16)], 64, None)
    with pytest.raises(RuntimeError, match="activations expected"):
        layer(torch.randn(2, 32))
    with pytest.raises(RuntimeError, match="out of the table"):
        ops.quant_embedding(torch.empty(1, 64), torch.tensor([16]), pack(fields), 0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 70, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_mul_as_the_results_are_stored(dtype, rows, bias):
    """gate and up in one segment (one type, split in two at construction) or two: SiLU-and-mul
    applied as the sums are stored, bit for bit what silu_and_mul gives on the unfused output."""
    for segments in ([fields_of("Q4_0", 96, 64, 3)], [fields_of("Q4_K", 48, 256, 4), fields_of("Q6_K", 48, 256, 5)]):
        k = segments[0].shape[1]
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        b = torch.randn(96).to(dtype) if bias else None
        packed = [(pack(f), f.format.format_id, f.shape[0]) for f in segments]
        fused, plain = (ops.QuantLinear(packed, k, b, silu) for silu in (True, False))
        expected = torch.empty(rows, 48, dtype=dtype)
        ops.silu_and_mul(expected, plain(x))
        assert torch.equal(fused(x), expected)
