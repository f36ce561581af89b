"""Quantized weight formats: GGUF's blocks decoded, packed for the C++ kernels, and the pure-torch
references the kernels are held to.

Every supported GGUF type stores a weight as an unsigned integer code u times a scale plus an
offset, per block of values along a row:

| type | bits | block | weight |
|---|---|---|---|
| Q4_0, Q5_0, Q8_0 | 4, 5, 8 | 32 | d (u - 8), d (u - 16), d (u - 128) (Q8_0's signed q as u = q + 128) |
| Q4_1, Q5_1 | 4, 5 | 32 | d u + m |
| Q4_K, Q5_K | 4, 5 | 256 = 8 x 32 | d sc_j u - dmin mn_j (sc, mn: 6-bit, one of each per 32) |
| Q6_K | 6 | 256 = 16 x 16 | d sc_j (u - 32) (sc: int8, one per 16) |

`decode` reads a type's raw blocks into those fields (`Fields`), exactly (tested against the gguf
package's own dequantizer). `pack` lays the fields out for the kernels (kernels/quant_linear.cpp):
rows in groups of 16, and for each group, block after block, one record holding the group's codes
so that one 32-bit lane of a 512-bit register holds 4 codes of one row, which VNNI's dpbusd
multiplies with 4 int8 activations broadcast to every lane; 16 rows are summed at once, with no
reduction across lanes. A record per (16 rows, block of 32) for the types of 32; per (16 rows,
256 values) for the K types:

    codes  4-5-6 bits: 256 bytes a 32-block, [step s 0..3][lane 0..15][4 bytes], byte i holding
           u[4s + i] in its low and u[16 + 4s + i] in its high nibble;
           8 bits: 512 bytes, [step t 0..7][lane][4 bytes] = u[4t + i];
    high   5 bits: 64 bytes a 32-block, byte 4 lane + i holding bit 4 of u[4t + i] as its bit t (t 0..7);
           6 bits: 128 bytes, two such planes: plane t // 4 holds bits 4-5 of u[4t + i] as its bits
           2 (t % 4) and 2 (t % 4) + 1;
    scales Q4_0..Q8_0: d (and m) as 16 float16; Q4_K/Q5_K: sc and mn as [8][16] uint8, then d and
           dmin as 16 float16 each; Q6_K: sc as [16][16] int8, then d as 16 float16.

The file's bytes are kept (the same bits a weight, to within 0.125), never expanded to floats.
Activations are quantized to int8 with a float scale per record's values (`quantize_activations`):
per 32 for the types of 32, per 256 for the K types, as llama.cpp quantizes them (its Q8_0 and Q8_K).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 16  # output rows a record holds, one per 32-bit lane of a 512-bit register
BLOCK = 32  # values an activation scale covers, and a code step's span


@dataclass(frozen=True)
class Format:
    name: str
    format_id: int  # the kernels' number for it (quant_linear.cpp's Format)
    bits: int
    block_values: int  # values in one GGUF block
    block_bytes: int  # bytes of one GGUF block
    offset: int = 0  # u - offset, for the types with no stored minimum
    has_min: bool = False  # Q4_1, Q5_1: a float minimum per block
    k_quant: bool = False

    @property
    def record_values(self) -> int:
        return 256 if self.k_quant else BLOCK

    @property
    def used_bytes(self) -> int:
        """A record's codes, high bits and scales."""
        blocks = self.record_values // BLOCK
        codes = (512 if self.bits == 8 else 256) * blocks
        high = {5: 64, 6: 128}.get(self.bits, 0) * blocks
        if not self.k_quant:
            scales = 2 * GROUP * (2 if self.has_min else 1)
        elif self.bits == 6:
            scales = 16 * GROUP + 2 * GROUP
        else:
            scales = 2 * 8 * GROUP + 2 * 2 * GROUP
        return codes + high + scales

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
        Format("Q6_K", 7, 6, 256, 210, offset=32, k_quant=True),
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


_DECODERS = {
    "Q4_0": _decode_legacy,
    "Q4_1": _decode_legacy,
    "Q5_0": _decode_legacy,
    "Q5_1": _decode_legacy,
    "Q8_0": _decode_legacy,
    "Q4_K": _decode_q45k,
    "Q5_K": _decode_q45k,
    "Q6_K": _decode_q6k,
}


def dequantize(fields: Fields) -> torch.Tensor:
    """The weights as float32 [rows, cols]: the reference every packed form is held to."""
    fmt = fields.format
    u = torch.from_numpy(fields.codes).float()
    rows, cols = u.shape

    def per(values: np.ndarray, span: int) -> torch.Tensor:
        return torch.from_numpy(values.astype(np.float32)).repeat_interleave(span, dim=1).view(rows, cols)

    if not fmt.k_quant:
        d = per(fields.scale, BLOCK)
        return d * u + per(fields.minimum, BLOCK) if fmt.has_min else d * (u - fmt.offset)
    d = per(fields.scale, 256)
    if fmt.bits == 6:
        return d * per(fields.sub_scale, 16) * (u - fmt.offset)
    return d * per(fields.sub_scale, BLOCK) * u - per(fields.minimum, 256) * per(fields.sub_min, BLOCK)


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
    if fmt.bits in (5, 6):
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
    """[g, lane, block, 32] codes -> [g, block, 256 or 512] bytes."""
    g, _, blocks, _ = codes.shape
    if bits == 8:
        steps = codes.reshape(g, GROUP, blocks, 8, 4)  # [g, lane, block, t, i]
    else:
        low, high = codes[..., :16] & 0x0F, codes[..., 16:] & 0x0F
        steps = (low | (high << 4)).reshape(g, GROUP, blocks, 4, 4)  # [g, lane, block, s, i]
    return steps.transpose(0, 2, 3, 1, 4).reshape(g, blocks, -1)


def _pack_high(codes: np.ndarray, bits: int) -> np.ndarray:
    """The bits of each code past its low 4: [g, block, 64 or 128] bytes, byte 4 lane + i of a plane
    holding, for each step t, the high bits of u[lane][4t + i]: 5 bits: bit t; 6 bits: plane t // 4,
    bits 2 (t % 4) and 2 (t % 4) + 1."""
    g, _, blocks, _ = codes.shape
    per_byte = 8 if bits == 5 else 4  # steps a byte serves
    high = ((codes >> 4) & (1 if bits == 5 else 3)).reshape(g, GROUP, blocks, 8 // per_byte, per_byte, 4)
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
    subs = 16 if fmt.bits == 6 else 8
    parts = [_by_lane(fields.sub_scale, rows, subs)]
    if fields.sub_min is not None:
        parts.append(_by_lane(fields.sub_min, rows, subs))
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
