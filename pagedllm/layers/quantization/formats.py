"""Quantized weight formats: GGUF's blocks decoded, packed for the C++ kernels, and the pure-torch
references the kernels are held to.

Every supported GGUF type stores a weight as an unsigned integer code u times a scale plus an
offset, per block of values along a row:

| type | bits | block | weight |
|---|---|---|---|
| Q4_0, Q5_0, Q8_0 | 4, 5, 8 | 32 | d (u - 8), d (u - 16), d (u - 128) (Q8_0's signed q as u = q + 128) |
| Q4_1, Q5_1 | 4, 5 | 32 | d u + m |
| IQ4_NL, MXFP4 | 4 | 32 | d T[u]: a 4-bit index into a table of 16 int8 values (MXFP4: e2m1 doubled, d = 2^(e-128)) |
| Q4_K, Q5_K | 4, 5 | 256 = 8 x 32 | d sc_j u - dmin mn_j (sc, mn: 6-bit, one of each per 32) |
| Q2_K | 2 | 256 = 16 x 16 | d sc_j u - dmin mn_j (sc, mn: 4-bit, one of each per 16) |
| Q6_K, Q3_K | 6, 3 | 256 = 16 x 16 | d sc_j (u - 32), d sc_j (u - 4) (sc: int8, one per 16) |
| IQ4_XS | 4 | 256 = 8 x 32 | d sc_j T[u] (sc: 6-bit less 32, per 32; IQ4_NL's table) |
| IQ3_S | 4 | 256 = 8 x 32 | d (1 + 2 s_j) T[u]: T the 16 odd values -15..15 (grid points and signs folded) |

`decode` reads a type's raw blocks into those fields (`Fields`), exactly (tested against the gguf
package's own dequantizer). `pack` lays the fields out for the kernels (kernels/quant_linear.cpp):
rows in groups of 16, and for each group, block after block, one record holding the group's codes
so that one 32-bit lane of a 512-bit register holds 4 codes of one row, which VNNI's dpbusd
multiplies with 4 int8 activations broadcast to every lane; 16 rows are summed at once, with no
reduction across lanes. A table's codes become T[u] + 128 as they are unpacked (one byte shuffle),
8-bit codes with an offset of 128. A record per (16 rows, block of 32) for the types of 32; per
(16 rows, 256 values) for the K types:

    codes  2-3 bits: 128 bytes a 32-block, [step s 0..1][lane 0..15][4 bytes], byte i holding
           u[8c + 4s + i] in its bits 2c, 2c + 1 (c 0..3);
           4-5-6 bits: 256 bytes a 32-block, [step s 0..3][lane 0..15][4 bytes], byte i holding
           u[4s + i] in its low and u[16 + 4s + i] in its high nibble;
           8 bits: 512 bytes, [step t 0..7][lane][4 bytes] = u[4t + i];
    high   3 and 5 bits: 64 bytes a 32-block, byte 4 lane + i holding bit 2 (bit 4) of u[4t + i] as
           its bit t (t 0..7); 6 bits: 128 bytes, two such planes: plane t // 4 holds bits 4-5 of
           u[4t + i] as its bits 2 (t % 4) and 2 (t % 4) + 1;
    scales types of 32: d (and m) as 16 float16 (MXFP4: float32); K types: sc as [subs][16] (uint8,
           or int8 for the types without minimums), mn as [subs][16] uint8 where there are
           minimums (Q2_K: sc | mn << 4 in one table, as the file pairs them), then d (and dmin)
           as 16 float16 each.

The file's bytes are kept (the same bits a weight to within 0.125, but Q3_K's sub-scales a byte
each, MXFP4's scale as float32 and IQ3_S's grid points as 4-bit codes a value),
never expanded to floats. Activations are quantized to int8 with a float scale per record's values
(`quantize_activations`): per 32 for the types of 32, per 256 for the K types, as llama.cpp
quantizes them (its Q8_0 and Q8_K).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

GROUP = 16  # output rows a record holds, one per 32-bit lane of a 512-bit register
BLOCK = 32  # values an activation scale covers, and a code step's span


IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
IQ3_S_VALUES = tuple(range(-15, 16, 2))  # a grid point's values with their signs: the odd -15..15
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled (d is halved)


@dataclass(frozen=True)
class Format:
    name: str
    format_id: int  # the kernels' number for it (quant_linear.cpp's Format)
    bits: int  # a code's bits in the records: 2, 3, 4, 5, 6 or 8
    block_values: int  # values in one GGUF block
    block_bytes: int  # bytes of one GGUF block
    offset: int = 0  # u - offset, for the types with no stored minimum
    has_min: bool = False  # Q4_1, Q5_1: a float minimum per block
    k_quant: bool = False  # records of 256 values with sub-block scales
    subs: int = 8  # a K record's sub-block scales a row: 8 (one per 32 values) or 16 (per 16)
    signed_subs: bool = False  # int8 sub-scales (u - offset); else uint8 ones with uint8 sub-minimums
    table: tuple[int, ...] | None = None  # 4-bit codes index it: u = table[code] + 128 (offset 128)
    scale_f32: bool = False  # d as float32 (MXFP4's powers of two), else float16
    paired_subs: bool = False  # Q2_K: 4-bit sub-scale and sub-minimum in one byte (scale low), as in the file

    @property
    def record_values(self) -> int:
        return 256 if self.k_quant else BLOCK

    @property
    def code_bytes(self) -> int:
        """A 32-value block's codes (16 rows) in the records."""
        return {2: 128, 3: 128, 8: 512}.get(self.bits, 256)

    @property
    def high_bytes(self) -> int:
        """A 32-value block's planes of the bits past a code's low 2 (3 bits) or 4 (5, 6 bits)."""
        return {3: 64, 5: 64, 6: 128}.get(self.bits, 0)

    @property
    def used_bytes(self) -> int:
        """A record's codes, high bits and scales."""
        blocks = self.record_values // BLOCK
        codes = (self.code_bytes + self.high_bytes) * blocks
        d = (4 if self.scale_f32 else 2) * GROUP
        if not self.k_quant:
            return codes + d * (2 if self.has_min else 1)
        subs = self.subs * GROUP * (1 if self.signed_subs or self.paired_subs else 2)
        return codes + subs + d * (1 if self.signed_subs else 2)

    @property
    def record_padding(self) -> int:
        """Zero bytes that end a K type's record on a cache line (Q6_K's 3360 bytes would leave every
        other record 32 bytes off, each 64-byte load of its codes then straddling two lines)."""
        return -self.used_bytes % 64 if self.k_quant else 0

    @property
    def record_bytes(self) -> int:
        return self.used_bytes + self.record_padding

    def packed_bytes(self, rows: int, cols: int) -> int:
        return -(-rows // GROUP) * (cols // self.record_values) * self.record_bytes


FORMATS = {
    f.name: f
    for f in (
        Format("Q4_0", 0, 4, 32, 18, offset=8),
        Format("Q4_1", 1, 4, 32, 20, has_min=True),
        Format("Q5_0", 2, 5, 32, 22, offset=16),
        Format("Q5_1", 3, 5, 32, 24, has_min=True),
        Format("Q8_0", 4, 8, 32, 34, offset=128),
        Format("Q4_K", 5, 4, 256, 144, k_quant=True),
        Format("Q5_K", 6, 5, 256, 176, k_quant=True),
        Format("Q6_K", 7, 6, 256, 210, offset=32, k_quant=True, subs=16, signed_subs=True),
        Format("Q2_K", 8, 2, 256, 84, k_quant=True, subs=16, paired_subs=True),
        Format("Q3_K", 9, 3, 256, 110, offset=4, k_quant=True, subs=16, signed_subs=True),
        Format("IQ4_NL", 10, 4, 32, 18, offset=128, table=IQ4_NL_VALUES),
        Format("IQ4_XS", 11, 4, 256, 136, offset=128, k_quant=True, signed_subs=True, table=IQ4_NL_VALUES),
        Format("MXFP4", 12, 4, 32, 17, offset=128, table=MXFP4_VALUES, scale_f32=True),
        Format("IQ3_S", 13, 4, 256, 110, offset=128, k_quant=True, signed_subs=True, table=IQ3_S_VALUES),
    )
}


@dataclass
class Fields:
    """A matrix's weights as codes and scales (see the module's table); numpy arrays, rows first."""

    format: Format
    codes: np.ndarray  # uint8 [rows, cols]
    scale: np.ndarray  # float16: d per block (types of 32) or per 256 (K types)
    minimum: np.ndarray | None = None  # float16: m per block (Q4_1, Q5_1), dmin per 256 (Q4_K, Q5_K)
    sub_scale: np.ndarray | None = None  # K types: uint8 sc per 32 (Q4_K, Q5_K), int8 per 16 (Q6_K)
    sub_min: np.ndarray | None = None  # Q4_K, Q5_K: uint8 mn per 32

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape


# -- GGUF blocks -> fields ----------------------------------------------------------------------
def decode(raw: np.ndarray, fmt: Format) -> Fields:
    """A tensor's raw GGUF bytes, [rows, bytes a row], as fields."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, fmt.block_bytes)
    return _DECODERS[fmt.name](blocks, fmt)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[.., 16] bytes -> [.., 32] codes: low nibbles first, then high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bytes [.., count / 8] -> bits [.., count]."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")[..., :count]


def _flat(codes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(codes.reshape(codes.shape[0], -1).astype(np.uint8))


def _decode_legacy(blocks: np.ndarray, fmt: Format) -> Fields:
    at = 2
    scale = _f16(blocks, 0)
    minimum = None
    if fmt.has_min:
        minimum, at = _f16(blocks, 2), 4
    if fmt.bits == 8:
        codes = (blocks[..., at : at + 32].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Fields(fmt, _flat(codes), scale, minimum)
    high = None
    if fmt.bits == 5:
        high, at = _high_bits(blocks[..., at : at + 4], 32), at + 4
    codes = _nibbles(blocks[..., at : at + 16])
    if high is not None:
        codes = codes | (high << 4)
    return Fields(fmt, _flat(codes), scale, minimum)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit minimums -> two [.., 8] arrays."""
    s = packed.astype(np.uint8)
    low = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    high_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([low[0], high_sc], -1), np.concatenate([low[1], high_mn], -1)


def _decode_q45k(blocks: np.ndarray, fmt: Format) -> Fields:
    rows, nb = blocks.shape[:2]
    sc, mn = _k_scales(blocks[..., 4:16])
    at = 16
    high = None
    if fmt.bits == 5:
        # qh[l] bit c: the high bit of sub-block c's value l
        high, at = _high_bits(blocks[..., 16:48, None], 8), 48  # [rows, nb, 32 l, 8 c]
        high = high.transpose(0, 1, 3, 2)  # [rows, nb, 8 c, 32 l]
    qs = blocks[..., at : at + 128].reshape(rows, nb, 4, 32)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, nb, 8, 32)
    if high is not None:
        codes = codes | (high << 4)
    return Fields(fmt, _flat(codes), _f16(blocks, 0), _f16(blocks, 2), sc.reshape(rows, -1), mn.reshape(rows, -1))


def _decode_q6k(blocks: np.ndarray, fmt: Format) -> Fields:
    rows, nb = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(rows, nb, 2, 2, 32)  # [half n][quarter pair][l]
    qh = blocks[..., 128:192].reshape(rows, nb, 2, 1, 32)  # [half n][l]
    # value 128 n + 32 q + l: low nibble of ql[n][q % 2][l] (q < 2) or its high nibble (q >= 2),
    # high 2 bits from qh[n][l] >> 2q
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # [rows, nb, n, q 0..3, l]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    codes = low | (high << 4)
    sub_scale = blocks[..., 192:208].view(np.int8).reshape(rows, -1)
    return Fields(fmt, _flat(codes), _f16(blocks, 208), None, np.ascontiguousarray(sub_scale))


def _shifted(data: np.ndarray, width: int, count: int) -> np.ndarray:
    """[.., n] bytes -> [.., count, n]: field c of each byte, `width` bits at bit width * c."""
    shifts = (np.arange(count, dtype=np.uint8) * width)[:, None]
    return (data[..., None, :] >> shifts) & ((1 << width) - 1)


def _decode_q2k(blocks: np.ndarray, fmt: Format) -> Fields:
    rows, nb = blocks.shape[:2]
    scales = blocks[..., 0:16]  # sub-block j: sc in the low nibble, mn in the high one
    qs = blocks[..., 16:80].reshape(rows, nb, 2, 32)  # value 128 n + 32 c + l: bits 2c of qs[n][l]
    codes = _shifted(qs, 2, 4)  # [rows, nb, n, c, l]
    return Fields(fmt, _flat(codes), _f16(blocks, 80), _f16(blocks, 82), _flat(scales & 0x0F), _flat(scales >> 4))


def _decode_q3k(blocks: np.ndarray, fmt: Format) -> Fields:
    rows, nb = blocks.shape[:2]
    high = _shifted(blocks[..., 0:32], 1, 8)  # value 32 b + l: bit b of hmask[l]
    low = _shifted(blocks[..., 32:96].reshape(rows, nb, 2, 32), 2, 4)  # value 128 n + 32 c + l
    codes = low.reshape(rows, nb, 256) | (high.reshape(rows, nb, 256) << 2)  # u - 4 is the weight's
    packed = blocks[..., 96:108]
    low_sc = _shifted(packed[..., 0:8], 4, 2).reshape(rows, nb, 16)  # j: nibble j // 8 of byte j % 8
    high_sc = _shifted(packed[..., 8:12], 2, 4).reshape(rows, nb, 16)  # j: bits 2 (j // 4) of byte 8 + j % 4
    sub_scale = ((low_sc | (high_sc << 4)).astype(np.int16) - 32).astype(np.int8)
    return Fields(fmt, _flat(codes), _f16(blocks, 108), None, _flat(sub_scale).view(np.int8))


def _decode_iq4nl(blocks: np.ndarray, fmt: Format) -> Fields:
    return Fields(fmt, _flat(_nibbles(blocks[..., 2:18])), _f16(blocks, 0))


def _decode_mxfp4(blocks: np.ndarray, fmt: Format) -> Fields:
    # E8M0's 2^(e - 127), halved for the doubled values: float32 bits (e - 1) << 23 (subnormal below 2)
    e = blocks[..., 0].astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
    return Fields(fmt, _flat(_nibbles(blocks[..., 1:17])), bits.view(np.float32))


def _decode_iq4xs(blocks: np.ndarray, fmt: Format) -> Fields:
    rows, nb = blocks.shape[:2]
    high = _shifted(blocks[..., 2:4].copy().view(np.uint16), 2, 8).reshape(rows, nb, 8).astype(np.uint8)
    low = _nibbles_pairs(blocks[..., 4:8])  # sub-block j: nibble j % 2 of byte j // 2
    sub_scale = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    codes = _nibbles(blocks[..., 8:136].reshape(rows, nb, 8, 16))
    return Fields(fmt, _flat(codes), _f16(blocks, 0), None, _flat(sub_scale).view(np.int8))


@functools.cache
def _iq3s_grid() -> np.ndarray:
    """IQ3_S's 512 grid points of 4 odd values each, as the gguf package holds them (imported here:
    the engine imports without it, as on the GPU check's machine)."""
    import gguf

    gguf.quants.IQ3_S.init_grid()
    return gguf.quants.IQ3_S.grid.reshape(512, 4).astype(np.int16)


def _decode_iq3s(blocks: np.ndarray, fmt: Format) -> Fields:
    rows, nb = blocks.shape[:2]
    index = blocks[..., 2:66].astype(np.int64) | (_high_bits(blocks[..., 66:74], 64).astype(np.int64) << 8)
    values = _iq3s_grid()[index].reshape(rows, nb, 256)  # grid point i: values 4i .. 4i + 3
    signs = _high_bits(blocks[..., 74:106], 256).astype(bool)  # value 8 j + b: bit b of byte j
    codes = (np.where(signs, -values, values) + 15) // 2  # the odd -15..15 -> their index 0..15
    sub_scale = 1 + 2 * _nibbles_pairs(blocks[..., 106:110]).astype(np.int16)
    return Fields(fmt, _flat(codes), _f16(blocks, 0), None, _flat(sub_scale.astype(np.int8)).view(np.int8))


def _nibbles_pairs(data: np.ndarray) -> np.ndarray:
    """[.., n] bytes -> [.., 2n]: each byte's low nibble, then its high one."""
    return _shifted(data, 4, 2).swapaxes(-1, -2).reshape(*data.shape[:-1], -1)


_DECODERS = {
    "Q4_0": _decode_legacy,
    "Q4_1": _decode_legacy,
    "Q5_0": _decode_legacy,
    "Q5_1": _decode_legacy,
    "Q8_0": _decode_legacy,
    "Q4_K": _decode_q45k,
    "Q5_K": _decode_q45k,
    "Q6_K": _decode_q6k,
    "Q2_K": _decode_q2k,
    "Q3_K": _decode_q3k,
    "IQ4_NL": _decode_iq4nl,
    "IQ4_XS": _decode_iq4xs,
    "MXFP4": _decode_mxfp4,
    "IQ3_S": _decode_iq3s,
}


def code_values(fmt: Format) -> np.ndarray:
    """u for each stored code: itself, or a table's value + 128."""
    return np.arange(256) if fmt.table is None else np.array(fmt.table) + 128


def dequantize(fields: Fields, device: torch.device | str = "cpu") -> torch.Tensor:
    """The weights as float32 [rows, cols] on `device` (the codes and scales copied there, the rest
    computed there: a GGUF file's weights on a GPU): the reference every packed form is held to."""
    fmt = fields.format
    table = torch.from_numpy(code_values(fmt).astype(np.float32)).to(device)
    u = table[torch.from_numpy(fields.codes).to(device).int()]
    rows, cols = u.shape

    def per(values: np.ndarray, span: int) -> torch.Tensor:
        scales = torch.from_numpy(values.astype(np.float32)).to(device)
        return scales.repeat_interleave(span, dim=1).view(rows, cols)

    if not fmt.k_quant:
        d = per(fields.scale, BLOCK)
        return d * u + per(fields.minimum, BLOCK) if fmt.has_min else d * (u - fmt.offset)
    d, span = per(fields.scale, 256), 256 // fmt.subs
    if fmt.signed_subs:
        return d * per(fields.sub_scale, span) * (u - fmt.offset)
    return d * per(fields.sub_scale, span) * u - per(fields.minimum, 256) * per(fields.sub_min, span)


# -- fields -> the kernels' records ----------------------------------------------------------------
def pack(fields: Fields) -> torch.Tensor:
    """The kernels' layout: uint8 [groups of 16 rows, records a row, record bytes] (rows padded with
    zero codes and scales, which compute to 0)."""
    fmt = fields.format
    rows, cols = fields.shape
    if cols % fmt.record_values:
        raise ValueError(f"{fmt.name} rows of {cols} values are not whole blocks of {fmt.record_values}")
    padded = -(-rows // GROUP) * GROUP
    codes = _pad_rows(fields.codes, padded).reshape(-1, GROUP, cols // BLOCK, BLOCK)  # [g, lane, block, 32]
    parts = [_pack_codes(codes, fmt.bits)]
    if fmt.high_bytes:
        parts.append(_pack_high(codes, fmt.bits))
    per_record = fmt.record_values // BLOCK
    parts = [p.reshape(p.shape[0], -1, per_record * p.shape[2]) for p in parts]
    parts += _pack_scales(fields, padded)
    if fmt.record_padding:
        parts.append(np.zeros((*parts[0].shape[:2], fmt.record_padding), np.uint8))
    record = np.concatenate(parts, axis=2)
    assert record.shape[2] == fmt.record_bytes, (record.shape, fmt.record_bytes)
    # Copied into torch's allocation, 64-byte aligned (numpy's is 16): whole cache lines a load.
    return torch.empty(record.shape, dtype=torch.uint8).copy_(torch.from_numpy(np.ascontiguousarray(record)))


def _pad_rows(values: np.ndarray, rows: int) -> np.ndarray:
    if values.shape[0] == rows:
        return values
    return np.concatenate([values, np.zeros((rows - values.shape[0], *values.shape[1:]), values.dtype)])


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """[g, lane, block, 32] codes -> [g, block, 128, 256 or 512] bytes."""
    g, _, blocks, _ = codes.shape
    if bits == 8:
        steps = codes.reshape(g, GROUP, blocks, 8, 4)  # [g, lane, block, t, i]
    elif bits <= 3:
        quarters = (codes & 3).reshape(g, GROUP, blocks, 4, 2, 4)  # [.., c, s, i]: u[8c + 4s + i]
        shifts = (2 * np.arange(4, dtype=np.uint8))[:, None, None]
        steps = (quarters << shifts).sum(axis=3, dtype=np.uint8)  # [g, lane, block, s, i]
    else:
        low, high = codes[..., :16] & 0x0F, codes[..., 16:] & 0x0F
        steps = (low | (high << 4)).reshape(g, GROUP, blocks, 4, 4)  # [g, lane, block, s, i]
    return steps.transpose(0, 2, 3, 1, 4).reshape(g, blocks, -1)


def _pack_high(codes: np.ndarray, bits: int) -> np.ndarray:
    """The bits of each code past its low 2 (3 bits) or 4: [g, block, 64 or 128] bytes, byte 4 lane + i
    of a plane holding, for each step t, the high bits of u[lane][4t + i]: 3 and 5 bits: bit t;
    6 bits: plane t // 4, bits 2 (t % 4) and 2 (t % 4) + 1."""
    g, _, blocks, _ = codes.shape
    per_byte = 4 if bits == 6 else 8  # steps a byte serves
    high = (codes >> (2 if bits == 3 else 4)) & (3 if bits == 6 else 1)
    high = high.reshape(g, GROUP, blocks, 8 // per_byte, per_byte, 4)
    width = 8 // per_byte  # bits a step takes
    shifts = (np.arange(per_byte, dtype=np.uint8) * width)[:, None]
    planes = (high.astype(np.uint16) << shifts).sum(axis=4).astype(np.uint8)  # [g, lane, block, plane, i]
    return planes.transpose(0, 2, 3, 1, 4).reshape(g, blocks, -1)


def _by_lane(values: np.ndarray, rows: int, per_record: int) -> np.ndarray:
    """[rows, n] per-row values -> [g, records, bytes]: record r holds its per_record values of
    each lane, value-major ([value][lane])."""
    values = _pad_rows(values, rows)
    g, n = rows // GROUP, values.shape[1]
    grouped = values.reshape(g, GROUP, n // per_record, per_record).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(grouped).view(np.uint8).reshape(g, n // per_record, -1)


def _pack_scales(fields: Fields, rows: int) -> list[np.ndarray]:
    fmt = fields.format
    if not fmt.k_quant:
        return [_by_lane(v, rows, 1) for v in (fields.scale, fields.minimum) if v is not None]
    if fmt.paired_subs:
        parts = [_by_lane(fields.sub_scale | (fields.sub_min << 4), rows, fmt.subs)]
    else:
        parts = [_by_lane(fields.sub_scale, rows, fmt.subs)]
        if fields.sub_min is not None:
            parts.append(_by_lane(fields.sub_min, rows, fmt.subs))
    return parts + [_by_lane(v, rows, 1) for v in (fields.scale, fields.minimum) if v is not None]


# -- online quantization of float weights -----------------------------------------------------------
def quantize_int8_rows(w: torch.Tensor, row_max: torch.Tensor | None = None) -> Fields:
    """Symmetric int8 with one scale per output row (per channel), as Q8_0 records whose blocks of
    a row share that scale: q = round(w / d), d = max |w_row| / 127 (as float16). `row_max`: the
    whole rows' max |w| where w holds part of each (a tensor-parallel rank's columns)."""
    w = w.float()
    d = ((w.abs().amax(dim=1) if row_max is None else row_max.float()) / 127).to(torch.float16)
    inverse = torch.where(d > 0, 1 / d.float(), torch.zeros(()))
    q = torch.round(w * inverse[:, None]).clamp(-127, 127)
    blocks = w.shape[1] // BLOCK
    return Fields(
        FORMATS["Q8_0"], (q + 128).to(torch.uint8).numpy(), d[:, None].expand(-1, blocks).contiguous().numpy()
    )


def quantize_int4_groups(w: torch.Tensor, group: int) -> Fields:
    """Asymmetric 4-bit per group of `group` values along a row (32 or a multiple: its blocks share
    the group's scale and minimum), as Q4_1 records: w ~ d u + m, u in 0..15, with d = (max - min) /
    15 and m = min rounded to float16 first, so that the codes fit the stored scales."""
    if group % BLOCK or w.shape[1] % group:
        raise ValueError(f"a group of {group} values does not divide rows of {w.shape[1]} into blocks of {BLOCK}")
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    d = ((high - low) / 15).to(torch.float16)
    m = low.to(torch.float16)
    inverse = torch.where(d > 0, 1 / d.float(), torch.zeros(()))
    u = torch.round((groups - m.float()[..., None]) * inverse[..., None]).clamp(0, 15).to(torch.uint8)
    per_block = group // BLOCK
    return Fields(
        FORMATS["Q4_1"],
        u.reshape(rows, cols).numpy(),
        d.repeat_interleave(per_block, dim=1).numpy(),
        m.repeat_interleave(per_block, dim=1).numpy(),
    )


# -- activations ------------------------------------------------------------------------------------
def activation_block(fmt: Format) -> int:
    """Values an activation scale covers for a type's layers: a record's (256 for the K types, as
    llama.cpp's Q8_K; 32 for the others, its Q8_0)."""
    return fmt.record_values


def quantize_activations(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] -> (int8 codes [rows, cols], float32 scales [rows, cols / block]): per `block`
    values, d = max |x| / 127 and q = round(x / d) (half to even), as the kernels compute them."""
    rows, cols = x.shape
    blocks = x.float().reshape(rows, cols // block, block)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).clamp(-127, 127)
    return q.to(torch.int8).reshape(rows, cols), d


def quantized_activations(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """x as the kernels see it: its int8 codes times their scales, in float64."""
    q, d = quantize_activations(x, block)
    return (q.double().view(*d.shape, block) * d.double()[..., None]).view(x.shape)


def reference_linear(x: torch.Tensor, fields: Fields) -> torch.Tensor:
    """What the kernels compute, in float64: the dequantized weights times the int8-quantized
    activations. Their only difference from it is the float32 order of their sums."""
    return quantized_activations(x, activation_block(fields.format)) @ dequantize(fields).double().T
