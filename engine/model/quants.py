"""Convert one GGUF tensor (``gguf.GGUFReader``'s ``ReaderTensor``) to MLX arrays.

Block-quantized GGUF types whose blocks map onto MLX affine quantization with
``group_size=32`` are repacked losslessly (no float round trip):

============  ======================  =========================================
GGUF type     GGUF formula            MLX affine triple (w = scale*q + bias)
============  ======================  =========================================
Q8_0          d*q, q int8             8-bit, q+128, scale d, bias -128d
Q4_0          d*(q-8)                 4-bit, scale d, bias -8d
Q4_1          d*q + m                 4-bit, scale d, bias m
Q5_0          d*(q-16)                5-bit, scale d, bias -16d
Q5_1          d*q + m                 5-bit, scale d, bias m
Q4_K / Q5_K   d*sc*q - dmin*m         4/5-bit, scale d*sc, bias -dmin*m
============  ======================  =========================================

MXFP4 (gpt-oss's experts: 32 4-bit e2m1 values and one e8m0 exponent per block) is MLX's own
``mode="mxfp4"`` format with group 32: the codes and exponent bytes are repacked, never decoded
(``_convert_mxfp4``; bit-exact with gguf-py's decoder, tested).

Q6_K, Q3_K and Q2_K use 16-element sub-blocks (MLX has no group size 16), so
they are decoded with gguf-py's block decoders (``gguf.quants.Q6_K`` etc., the
code behind ``gguf.quants.dequantize``) and requantized to 8-bit
affine g32 with ``mx.quantize``.

MLX packs quantized values as one little-endian bit stream per row: value i
occupies bits [i*bits, (i+1)*bits) of the row, counting from bit 0 of word 0
upwards.  For 5 bits that means values straddle uint32 words (8 values per
40 bits = 5 bytes); this was established by dequantizing single-bit words and
is checked again by the tests.

Shapes follow MLX: a GGUF tensor of GGUF shape [ne0, ne1] (ne0 contiguous,
= input width) becomes (ne1, ne0) = (out, in).  Quantized weights are
(out, in*bits/32) uint32 with scales/biases (out, in/32).  1-D tensors stay 1-D
(a 1-D block-quantized tensor, which real files do not contain, is dequantized
to dense).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

__all__ = ["HELD_BITS", "MlxTensor", "UnsupportedTensorType", "convert_tensor", "decode_exact", "summarize"]

GROUP_SIZE = 32
QK_K = 256

T = GGMLQuantizationType


@dataclass
class MlxTensor:
    weight: mx.array  # dense (dtype = requested dtype) or packed uint32 when quantized
    scales: mx.array | None  # (out, in/32), requested dtype
    biases: mx.array | None
    bits: int | None  # 4, 5, 8 when quantized
    group_size: int | None  # 32
    note: str  # e.g. "Q4_K -> 4-bit affine g32 (exact)"
    mode: str = "affine"  # MLX quantization mode: "affine" (scales+biases) or "mxfp4" (uint8 scales, no biases)

    @property
    def quantized(self) -> bool:
        return self.bits is not None


class UnsupportedTensorType(ValueError):
    """Raised for a GGUF tensor type Strata cannot convert."""


# ---------------------------------------------------------------------------
# small helpers


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 (possibly a strided view) -> (n,) float32."""
    return np.ascontiguousarray(b).view(np.float16)[:, 0].astype(np.float32)


def _pack_4bit_pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF stores 32 4-bit values of a group as 16 bytes: low nibbles are values
    0..15, high nibbles values 16..31.  MLX wants byte k = v[2k] | v[2k+1] << 4.
    ``a``/``b`` are the even/odd source bytes; returns the MLX bytes for values
    0..15 (from the low nibbles) and 16..31 (from the high nibbles)."""
    lo = (a & 0x0F) | (b << 4)
    hi = (a >> 4) | (b & 0xF0)
    return lo, hi


def _pack_5bit(q: np.ndarray) -> np.ndarray:
    """q: uint8 values < 32, size divisible by 8 -> uint8 bytes (-1, 5), 5 bytes per
    8 values, LSB-first bit stream (MLX's 5-bit layout)."""
    v = q.reshape(-1, 8)
    v0, v1, v2, v3, v4, v5, v6, v7 = (v[:, i] for i in range(8))
    out = np.empty((len(v), 5), np.uint8)
    # uint8 shifts drop the bits that move into the next byte, as intended
    out[:, 0] = v0 | (v1 << 5)
    out[:, 1] = (v1 >> 3) | (v2 << 2) | (v3 << 7)
    out[:, 2] = (v3 >> 1) | (v4 << 4)
    out[:, 3] = (v4 >> 4) | (v5 << 1) | (v6 << 6)
    out[:, 4] = (v6 >> 2) | (v7 << 3)
    return out


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K/Q5_K -> (n, 8), (n, 8) uint8."""
    s = np.ascontiguousarray(scales).reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


# Each repacker takes blocks (n_blocks, type_size) uint8 and returns
# (packed bytes (n_blocks, block_size*bits/8) uint8 in MLX order,
#  scales float32 (n_blocks * block_size/32,), biases float32 (same)).


def _repack_q8_0(blk):
    d = _f16(blk[:, 0:2])
    q = blk[:, 2:34] ^ np.uint8(0x80)  # int8 q -> q + 128 as uint8
    return q, d, -128.0 * d


def _repack_q4_0(blk):
    d = _f16(blk[:, 0:2])
    qs = blk[:, 2:18]
    lo, hi = _pack_4bit_pairs(qs[:, 0::2], qs[:, 1::2])
    return np.concatenate([lo, hi], axis=1), d, -8.0 * d


def _repack_q4_1(blk):
    d = _f16(blk[:, 0:2])
    m = _f16(blk[:, 2:4])
    qs = blk[:, 4:20]
    lo, hi = _pack_4bit_pairs(qs[:, 0::2], qs[:, 1::2])
    return np.concatenate([lo, hi], axis=1), d, m


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: qh (n, 4) bytes = little-endian uint32 of high bits, qs (n, 16)."""
    high = np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")  # (n, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return low | (high << 4)


def _repack_q5_0(blk):
    d = _f16(blk[:, 0:2])
    q = _q5_values(blk[:, 2:6], blk[:, 6:22])
    return _pack_5bit(q).reshape(len(blk), 20), d, -16.0 * d


def _repack_q5_1(blk):
    d = _f16(blk[:, 0:2])
    m = _f16(blk[:, 2:4])
    q = _q5_values(blk[:, 4:8], blk[:, 8:24])
    return _pack_5bit(q).reshape(len(blk), 20), d, m


def _k_scales(blk):
    d = _f16(blk[:, 0:2])[:, None]
    dmin = _f16(blk[:, 2:4])[:, None]
    sc, mn = _k_scale_min(blk[:, 4:16])
    return (d * sc.astype(np.float32)).ravel(), (-(dmin * mn.astype(np.float32))).ravel()


def _repack_q4_k(blk):
    n = len(blk)
    scales, biases = _k_scales(blk)
    qs = blk[:, 16:144].reshape(n, 4, 32)  # chunk i: low nibbles = sub-block 2i, high = 2i+1
    lo, hi = _pack_4bit_pairs(qs[:, :, 0::2], qs[:, :, 1::2])  # (n, 4, 16) each
    packed = np.stack([lo, hi], axis=2).reshape(n, 128)
    return packed, scales, biases


def _repack_q5_k(blk):
    n = len(blk)
    scales, biases = _k_scales(blk)
    qh = blk[:, 16:48]  # bit j of qh[k] = high bit of element 32*j + k
    qs = blk[:, 48:176].reshape(n, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = low | (high << 4)
    return _pack_5bit(q).reshape(n, 160), scales, biases


_EXACT = {
    T.Q8_0: (8, _repack_q8_0),
    T.Q4_0: (4, _repack_q4_0),
    T.Q4_1: (4, _repack_q4_1),
    T.Q5_0: (5, _repack_q5_0),
    T.Q5_1: (5, _repack_q5_1),
    T.Q4_K: (4, _repack_q4_k),
    T.Q5_K: (5, _repack_q5_k),
}

# Types MLX cannot hold as they are (16-value sub-block scales, lookup grids, ternary codes): decoded
# exactly with gguf-py's block decoders (llama.cpp's grids and sign tables), then held as MLX affine g32
# at the bits measured per type (bench/quants.md says what each choice measured).
HELD_BITS = {
    T.Q6_K: 8, T.Q3_K: 8, T.Q2_K: 8,
    T.IQ4_NL: 8, T.IQ4_XS: 8, T.IQ3_XXS: 6, T.IQ3_S: 4, T.IQ2_XXS: 8, T.IQ2_XS: 8, T.IQ2_S: 8,
    T.IQ1_S: 2, T.IQ1_M: 8,
    T.TQ1_0: 2, T.TQ2_0: 2,
}
# IQ1_S: 3 evenly spaced levels per group of 32 (its scale and delta are per 32): 2-bit exact (_hold_iq1s).
# Ternary types: every value is -d, 0 or d with one d per 256-value block, so 2-bit affine with scale d
# and bias -d holds them exactly (mx.quantize would not: it keeps 0 on its grid and clips one end).
_TERNARY = {T.TQ1_0, T.TQ2_0}


def _zero(spans):
    """A probe edit: zero these byte spans of each block (grid index 0, sign bits clear)."""
    def edit(b):
        for lo, hi in spans:
            b[:, lo:hi] = 0
    return edit


def _zero_words_low28(lo, hi):
    """Zero the low 28 bits (sign indices) of the little-endian uint32 words in bytes lo:hi; the top 4
    (the sub-block scale) stay."""
    def edit(b):
        w = b[:, lo:hi].reshape(len(b), -1, 4)
        w[:, :, :3] = 0
        w[:, :, 3] &= 0xF0
        b[:, lo:hi] = w.reshape(len(b), -1)
    return edit


def _iq2xxs_probe(b):
    g = b[:, 2:66].reshape(len(b), 8, 8)     # per 32 values: 4 grid indices, then scale<<28 | signs
    g[:, :, :7] = 0
    g[:, :, 7] &= 0xF0
    b[:, 2:66] = g.reshape(len(b), 64)


@dataclass(frozen=True)
class Lattice:
    """Grid types whose every group of 32 lies on a uniform lattice: value = u * (q * step + offset) with
    u the group's unit, q an integer in 0 .. 2**bits - 1. u comes from a probe: the blocks with their
    grid indices set to an entry whose values are all `probe_value` and their signs cleared, decoded by
    the same decoder (so u carries the sub-block scale exactly as llama.cpp computes it)."""
    bits: int
    probe: object            # edits a copy of the blocks (n, type_size) in place
    probe_value: int         # the value every element of the probe decodes to, in units of u
    step: float
    offset: float


def _iq4_probe(start):
    def edit(b):
        b[:, start:] = 0x88              # both nibbles 8: kvalues[8] = 1
    return edit


# IQ4_*: values d * kvalues[q], kvalues integers -127..113: 8-bit, step 1, offset -127.
# IQ3_S: d * (odd 1..15) * sign: 4-bit, step 2, offset -15 (iq3s_grid[0] is all 1).
# IQ3_XXS: d * {4, 12, .., 52, 62} * sign: in units of 2d, -31..31: 6-bit (iq3xxs_grid[0] is all 4).
# IQ2_XXS: d * {8, 25, 43} * sign: -43..43, 87 levels: 8-bit (MLX has no 7-bit; iq2xxs_grid[0] is all 8).
_LATTICES = {
    T.IQ4_NL: Lattice(8, _iq4_probe(2), 1, 1.0, -127.0),
    T.IQ4_XS: Lattice(8, _iq4_probe(8), 1, 1.0, -127.0),
    T.IQ3_S: Lattice(4, _zero([(2, 106)]), 1, 2.0, -15.0),
    T.IQ3_XXS: Lattice(6, lambda b: (_zero([(2, 66)])(b), _zero_words_low28(66, 98)(b)), 4, 2.0, -62.0),
    T.IQ2_XXS: Lattice(8, _iq2xxs_probe, 8, 1.0, -43.0),
}
_LATTICE_SLACK = 1e-3        # |value/step - nearest lattice point| accepted as float rounding

_REQUANT = set(HELD_BITS)
_REQUANT_CHUNK = 1 << 20  # values decoded per step

_DENSE = {T.F32, T.F16, T.BF16}


# ---------------------------------------------------------------------------
# public API


def _type_name(t) -> str:
    try:
        return GGMLQuantizationType(int(t.tensor_type)).name
    except ValueError:
        return f"type {int(t.tensor_type)}"


def convert_tensor(t, dtype: mx.Dtype = mx.float32, held_bits: int | None = None) -> MlxTensor:
    """Convert a ``gguf.ReaderTensor`` to MLX arrays (see module docstring). ``held_bits`` overrides
    HELD_BITS for a decoded type (the bench measures each form)."""
    name = t.name
    try:
        qtype = GGMLQuantizationType(int(t.tensor_type))
    except ValueError:
        qtype = None
    if qtype == T.MXFP4 and len(t.shape) >= 2:
        return _convert_mxfp4(t)
    if qtype is None or (qtype not in _DENSE and qtype not in _EXACT and qtype not in _REQUANT
                         and qtype != T.MXFP4):
        raise UnsupportedTensorType(
            f"tensor '{name}' has type {_type_name(t)}, which Strata cannot read"
        )

    shape = tuple(int(x) for x in reversed(list(t.shape)))  # MLX order
    data = np.asarray(t.data)
    dname = _dtype_name(dtype)

    if qtype in _DENSE:
        if qtype == T.BF16:
            raw = np.ascontiguousarray(data).view(np.uint16).reshape(shape)
            arr = mx.array(raw).view(mx.bfloat16)
        else:
            arr = mx.array(data.reshape(shape))
        if arr.dtype != dtype:
            arr = arr.astype(dtype)
        same = {T.F32: mx.float32, T.F16: mx.float16, T.BF16: mx.bfloat16}[qtype] == dtype
        note = qtype.name if same else f"{qtype.name} -> {dname}"
        return MlxTensor(arr, None, None, None, None, note)

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    in_features = shape[-1]
    if in_features % block_size:
        raise ValueError(f"tensor '{name}': row width {in_features} is not a multiple of {block_size}")
    blocks = data.reshape(-1, type_size)

    if len(shape) < 2:
        # No real model has these; keep 1-D tensors 1-D by dequantizing.
        dense = _block_decoder(qtype)(blocks).reshape(shape)
        return MlxTensor(mx.array(dense).astype(dtype), None, None, None, None,
                         f"{qtype.name} -> {dname} (dequantized 1-D)")

    lead = shape[:-1]
    n_groups_row = in_features // GROUP_SIZE

    if qtype in _EXACT:
        bits, repack = _EXACT[qtype]
        packed, scales, biases = repack(blocks)
        words = np.ascontiguousarray(packed).reshape(-1, in_features * bits // 8).view(np.uint32)
        weight = mx.array(words.reshape(*lead, in_features * bits // 32))
        s = scales.astype(np.float32, copy=False).reshape(*lead, n_groups_row)
        b = biases.astype(np.float32, copy=False).reshape(*lead, n_groups_row)
        exact = "exact"
        if dtype != mx.float32:
            ms, mb = mx.array(s).astype(dtype), mx.array(b).astype(dtype)
            if not (np.array_equal(np.array(ms.astype(mx.float32)), s)
                    and np.array_equal(np.array(mb.astype(mx.float32)), b)):
                exact = f"scales rounded to {dname}"
        else:
            ms, mb = mx.array(s), mx.array(b)
        return MlxTensor(weight, ms, mb, bits, GROUP_SIZE,
                         f"{qtype.name} -> {bits}-bit affine g{GROUP_SIZE} ({exact})")

    bits = held_bits or HELD_BITS[qtype]
    w, s, b, exact = _decode_and_hold(blocks, qtype, in_features, bits)
    w = w.reshape(*lead, in_features * bits // 32)
    s, b = s.reshape(*lead, n_groups_row), b.reshape(*lead, n_groups_row)
    if dtype != mx.float32:
        s, b = s.astype(dtype), b.astype(dtype)
    how = "exact" if exact else "requantized"
    return MlxTensor(w, s, b, bits, GROUP_SIZE, f"{qtype.name} -> {bits}-bit affine g{GROUP_SIZE} ({how})")


def _block_decoder(qtype):
    """gguf-py's vectorised block decoder for the type (gguf.quants.IQ2_XXS etc.), its grid unpacked."""
    cls = getattr(gguf_quants, qtype.name)
    cls.init_grid()                 # the IQ grids are unpacked on first use; a no-op for the others
    return cls.dequantize_blocks


def decode_exact(t) -> np.ndarray:
    """The exact float32 decode of a quantized tensor in MLX (out, in) order, whole (for checks and
    the bench on small tensors; convert_tensor decodes in bounded chunks)."""
    qtype = GGMLQuantizationType(int(t.tensor_type))
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    blocks = np.asarray(t.data).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    return _block_decoder(qtype)(blocks).reshape(shape)


def _decode_and_hold(blocks: np.ndarray, qtype, in_features: int, bits: int):
    """Decode rows in chunks of ~1M values (bounded float32 temporaries; gguf's block decoder on a chunk
    is ~3x faster than gguf.quants.dequantize, which goes 16 rows at a time) and hold each chunk as
    `bits`-bit affine g32. Returns (packed, scales, biases) with one row per tensor row."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    decode = _block_decoder(qtype)
    rows = blocks.reshape(-1, in_features // block_size * type_size)
    step = max(1, _REQUANT_CHUNK // in_features)
    ws, ss, bs = [], [], []
    exact = True
    for r0 in range(0, len(rows), step):
        chunk = rows[r0:r0 + step]
        dense = decode(chunk.reshape(-1, type_size)).reshape(len(chunk), in_features)
        held = None
        if qtype in _TERNARY and bits == 2:
            held = _hold_ternary(dense)
        elif qtype == T.IQ1_S and bits == 2:
            held = _hold_iq1s(chunk.reshape(-1, type_size), dense)
        elif qtype in _LATTICES and bits == _LATTICES[qtype].bits:
            held = _hold_lattice(chunk.reshape(-1, type_size), dense, _LATTICES[qtype], decode)
        if held is not None:
            w, s, b = held
        else:
            exact = False
            w, s, b = mx.quantize(mx.array(dense), group_size=GROUP_SIZE, bits=bits)
        mx.eval(w, s, b)
        ws.append(w), ss.append(s), bs.append(b)
    w, s, b = (x[0] if len(x) == 1 else mx.concatenate(x, axis=0) for x in (ws, ss, bs))
    return w, s, b, exact


def _hold_lattice(blocks: np.ndarray, dense: np.ndarray, lat: Lattice, decode):
    """Exact `lat.bits`-bit affine g32 for values on the type's lattice, or None when some group is
    not (a NaN or inf scale in a damaged file): the caller then requantizes."""
    probe = np.array(blocks)                  # a copy: the file is mapped read-only
    lat.probe(probe)
    unit = decode(probe).reshape(dense.shape) / np.float32(lat.probe_value)
    scale = unit * np.float32(lat.step)
    bias = unit * np.float32(lat.offset)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(scale != 0, (dense - bias) / scale, 0.0)
    q = np.rint(x)
    if not (np.all(np.abs(x - q) <= _LATTICE_SLACK) and q.min() >= 0 and q.max() < 1 << lat.bits):
        return None
    rows, n = dense.shape
    packed = _pack_bits(q.astype(np.uint8), lat.bits).reshape(rows, n * lat.bits // 32)
    per_group = lambda a: np.ascontiguousarray(a.reshape(rows, n // GROUP_SIZE, GROUP_SIZE)[:, :, 0])  # noqa: E731
    return mx.array(packed), mx.array(per_group(scale)), mx.array(per_group(bias))


def _hold_iq1s(blocks: np.ndarray, dense: np.ndarray):
    """IQ1_S: each group of 32 is dl * (g + delta) with g in {-1, 0, 1} (iq1s_grid), dl and delta = +-1/8
    from the group's 16-bit qh word, so 2-bit affine with scale dl and bias dl * (delta - 1) holds it
    exactly (codes g + 1). None when a group is off that lattice (a NaN or inf scale): requantized."""
    rows, n = dense.shape
    d = _f16(blocks[:, 0:2])[:, None]
    qh = np.ascontiguousarray(blocks[:, 34:50]).view(np.uint16)            # (blocks, 8): one per 32 values
    scale = (d * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)).reshape(rows, n // GROUP_SIZE)
    delta = np.where(qh & 0x8000, np.float32(-0.125), np.float32(0.125)).reshape(rows, n // GROUP_SIZE)
    bias = scale * (delta - np.float32(1))
    per_value = lambda a: np.repeat(a, GROUP_SIZE, axis=1)  # noqa: E731
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(per_value(scale) != 0, (dense - per_value(bias)) / per_value(scale), 0.0)
    q = np.rint(x)
    if not (np.all(np.abs(x - q) <= _LATTICE_SLACK) and q.min() >= 0 and q.max() <= 2):
        return None
    packed = _pack_bits(q.astype(np.uint8), 2).reshape(rows, n * 2 // 32)
    return mx.array(packed), mx.array(scale), mx.array(bias)


def _pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 values < 2**bits -> uint32 words, MLX's LSB-first bit stream per row (rows whose width is a
    multiple of 32, so no value crosses into the next row)."""
    if bits == 8:
        return np.ascontiguousarray(q).view(np.uint32)
    if bits == 5:
        return _pack_5bit(q).view(np.uint32)
    stream = np.unpackbits(q[..., None], axis=-1, count=bits, bitorder="little")
    return np.packbits(stream.reshape(*q.shape[:-1], -1), axis=-1, bitorder="little").view(np.uint32)


def _hold_ternary(dense: np.ndarray):
    """(rows, n) values each -d, 0 or d per 256-value block -> 2-bit codes (value/d + 1), scale d and
    bias -d per group of 32: exact. d is the block's largest magnitude (any d serves an all-zero block)."""
    rows, n = dense.shape
    blk = dense.reshape(rows, n // QK_K, QK_K)
    d = np.abs(blk).max(axis=-1, keepdims=True)
    d[d == 0] = 1.0
    q = (np.rint(blk / d) + 1).astype(np.uint8).reshape(rows, n)
    packed = q[:, 0::4] | (q[:, 1::4] << 2) | (q[:, 2::4] << 4) | (q[:, 3::4] << 6)   # LSB-first stream
    words = np.ascontiguousarray(packed).view(np.uint32)
    scales = np.repeat(d.reshape(rows, -1), QK_K // GROUP_SIZE, axis=1).astype(np.float32)
    return mx.array(words), mx.array(scales), mx.array(-scales)


def _convert_mxfp4(t) -> MlxTensor:
    """GGUF MXFP4 -> MLX mxfp4, lossless. A GGUF block is 1 byte e (e8m0) then 16 bytes whose low
    nibbles are values 0..15 and high nibbles values 16..31; a value is kvalues[q] * 2^(e-128) with
    kvalues the e2m1 table doubled, i.e. e2m1(q) * 2^(e-127): MLX's mxfp4 with the same 4-bit codes
    and the same exponent byte. Only the nibble order changes (MLX: byte k = v[2k] | v[2k+1] << 4).
    Scales stay uint8 whatever the model dtype (MLX reads them as exponents)."""
    shape = tuple(int(x) for x in reversed(list(t.shape)))  # MLX order
    in_features = shape[-1]
    if in_features % GROUP_SIZE:
        raise ValueError(f"tensor '{t.name}': row width {in_features} is not a multiple of {GROUP_SIZE}")
    blocks = np.asarray(t.data).reshape(-1, GGML_QUANT_SIZES[T.MXFP4][1])
    qs = blocks[:, 1:]
    lo, hi = _pack_4bit_pairs(qs[:, 0::2], qs[:, 1::2])
    packed = np.concatenate([lo, hi], axis=1)
    weight = mx.array(np.ascontiguousarray(packed).reshape(-1, in_features // 2).view(np.uint32)
                      .reshape(*shape[:-1], in_features // 8))
    scales = mx.array(np.ascontiguousarray(blocks[:, 0]).reshape(*shape[:-1], in_features // GROUP_SIZE))
    return MlxTensor(weight, scales, None, 4, GROUP_SIZE, "MXFP4 -> mxfp4 g32 (exact)", mode="mxfp4")


def summarize(notes: Iterable[str]) -> str:
    """One log line with counts per conversion, most frequent first."""
    counts = Counter(notes)
    return ", ".join(f"{n} x {note}" for note, n in counts.most_common())
