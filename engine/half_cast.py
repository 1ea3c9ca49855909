"""float16 <-> float32 casts for session files on the CPU, bit for bit what numpy's own cast gives.

Why: on x86 numpy casts half precision one element at a time (~1.6 ns per float16 -> float32 and
~2.9 ns per float32 -> float16 on this project's CI machine), and those casts were most of a CPU
session save's and restore's own work (bench/README.md). Done with the bit layouts instead -- integer
and float ops that numpy runs with SIMD, on chunks small enough to stay in cache -- they take about
half the time. Both directions are checked against numpy on every float16 value, and float32 -> float16
on every rounding boundary (tests/engine/test_half_cast.py).

    float16 -> float32: (bits & 0x7fff) << 13, read as float32 and multiplied by 2**112, is exact for
        zeros, subnormals and normals; inf and NaN (exponent 31) get exponent 255 and keep their
        payload; then the sign.
    float32 -> float16: round to nearest even. Normals: (a - (112 << 23) + 0xfff + odd) >> 13, the
        carry rounding up into the exponent (to inf past 65504, as numpy); below 2**-14 the FPU's own
        rounding does it (a + 0.5f, minus 0.5f's bits); at or past 2**16 inf, and NaN as numpy writes it
        (0x7c00 + the top ten payload bits, 0x7c01 when those are zero).
"""
from __future__ import annotations

import numpy as np

CHUNK = 1 << 17                     # elements per pass: the temporaries stay in L2
_MAGIC_UP = np.float32(2.0 ** 112)
_HALF = np.float32(0.5)
_HALF_BITS = np.uint32(0x3F000000)
_NORMAL_MIN = np.uint32(113 << 23)  # 2**-14, float16's smallest normal, as float32 bits
_INF_FROM = np.uint32(143 << 23)    # 2**16: at or above it a float32 is inf (or NaN) in float16
_F32_INF = np.uint32(0x7F800000)
_REBIAS = np.uint32((0xFFF - (112 << 23)) & 0xFFFFFFFF)


def _rows_contiguous(a: np.ndarray) -> bool:
    """Whether each a[i, ..., :, :] (the last two axes) is one contiguous block."""
    return a.ndim >= 2 and a.strides[-1] == a.itemsize and a.strides[-2] == a.shape[-1] * a.itemsize


def _flat_pairs(dst: np.ndarray, src: np.ndarray):
    """(dst, src) 1-D contiguous pieces covering both arrays, or None when they are not laid out so."""
    if dst.shape != src.shape:
        raise ValueError(f"cast: shapes differ ({dst.shape} vs {src.shape})")
    if dst.flags.c_contiguous and src.flags.c_contiguous:
        return [(dst.reshape(-1), src.reshape(-1))]
    if _rows_contiguous(dst) and _rows_contiguous(src):
        # e.g. a padded cache's (1, heads, n, dim) slice: each head is contiguous
        return [(dst[i].reshape(-1), src[i].reshape(-1)) for i in np.ndindex(*dst.shape[:-2])]
    return None


def _f16_to_f32(dst: np.ndarray, src: np.ndarray) -> None:
    u16 = src.view(np.uint16)
    out = dst.view(np.uint32)
    n = len(src)
    t = np.empty(min(n, CHUNK), np.uint32)
    s = np.empty(min(n, CHUNK), np.uint32)
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        tt, ss, o = t[:b - a], s[:b - a], out[a:b]
        np.copyto(tt, u16[a:b])
        np.bitwise_and(tt, 0x8000, out=ss)
        np.left_shift(ss, 16, out=ss)
        np.bitwise_and(tt, 0x7FFF, out=tt)
        special = tt.max() >= 0x7C00
        np.left_shift(tt, 13, out=tt)
        np.multiply(tt.view(np.float32), _MAGIC_UP, out=o.view(np.float32))
        if special:
            sel = tt >= (0x7C00 << 13)
            o[sel] = tt[sel] | _F32_INF
        np.bitwise_or(o, ss, out=o)


@np.errstate(invalid="ignore")          # NaN + 0.5 below: its result is overwritten
def _f32_to_f16(dst: np.ndarray, src: np.ndarray) -> None:
    x32 = src.view(np.uint32)
    out = dst.view(np.uint16)
    n = len(src)
    m = min(n, CHUNK)
    a_, o_, s_, f_ = (np.empty(m, np.uint32) for _ in range(4))
    low = np.empty(m, np.bool_)
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        x, av, o, s, f, lo = x32[a:b], a_[:b - a], o_[:b - a], s_[:b - a], f_[:b - a], low[:b - a]
        np.bitwise_and(x, 0x7FFFFFFF, out=av)
        # normal range, round to nearest even
        np.right_shift(av, 13, out=o)
        np.bitwise_and(o, 1, out=o)
        np.add(o, av, out=o)
        np.add(o, _REBIAS, out=o)
        np.right_shift(o, 13, out=o)
        # below 2**-14 (subnormals and zeros): the FPU rounds
        np.less(av, _NORMAL_MIN, out=lo)
        if lo.any():
            np.add(av.view(np.float32), _HALF, out=f.view(np.float32))
            np.subtract(f, _HALF_BITS, out=f)
            np.copyto(o, f, where=lo)
        if av.max() >= _INF_FROM:
            big = av >= _INF_FROM
            o[big] = 0x7C00
            nan = av > _F32_INF
            if nan.any():
                payload = ((av[nan] & 0x7FFFFF) >> 13) + 0x7C00
                payload[payload == 0x7C00] = 0x7C01
                o[nan] = payload
        np.right_shift(x, 16, out=s)
        np.bitwise_and(s, 0x8000, out=s)
        np.bitwise_or(o, s, out=o)
        np.copyto(out[a:b], o, casting="unsafe")


def cast(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, float16 <-> float32 (bit-exact with numpy's cast); anything else, or a layout
    this does not handle, goes to np.copyto."""
    pairs = None
    kind = (src.dtype, dst.dtype)
    if kind in ((np.dtype(np.float16), np.dtype(np.float32)), (np.dtype(np.float32), np.dtype(np.float16))):
        pairs = _flat_pairs(dst, src)
    if pairs is None:
        np.copyto(dst, src, casting="unsafe")
        return
    fn = _f16_to_f32 if src.dtype == np.float16 else _f32_to_f16
    for d, s in pairs:
        fn(d, s)
