"""float16 <-> float32 casts for session files on the CPU, bit for bit what numpy's own cast gives.

Why: on x86 numpy casts half precision one element at a time (~1.6 ns per float16 -> float32 and
~2.9 ns per float32 -> float16 on this project's CI machine), and those casts were most of a CPU
session save's and restore's own work (bench/README.md). Done with the bit layouts instead -- integer
and float ops that numpy runs with SIMD, on chunks small enough to stay in cache -- they take about
half the time. Both directions are checked against numpy on every float16 value, and float32 -> float16
on every rounding boundary (tests/engine/test_half_cast.py).

    float16 -> float32: the bits sign-extended to 32, shifted left by 13 and masked to the sign and the
        15 bits below bit 28 are the float16's sign, exponent and mantissa at float32's places; read as
        float32 and multiplied by 2**112 that is exact for zeros, subnormals and normals, signs
        included; inf and NaN (exponent 31) come out at or past 2**16 and get exponent 255, keeping
        their payload.
    float32 -> float16: round to nearest even. Normals: (a - (112 << 23) + 0xfff + odd) >> 13, the
        carry rounding up into the exponent (to inf past 65504, as numpy); below 2**-14 the FPU's own
        rounding does it (a + 0.5f, minus 0.5f's bits); at or past 2**16 inf, and NaN as numpy writes it
        (0x7c00 + the top ten payload bits, 0x7c01 when those are zero).
"""
from __future__ import annotations

import numpy as np

CHUNK = 1 << 18                     # elements per pass: fewer numpy calls; the temporaries stay near L2
_MAGIC_UP = np.float32(2.0 ** 112)
_WIDE_KEEP = np.int32(-0x70002000)  # 0x8FFFE000: the sign bit and the 15 bits below bit 28
_EXP31 = np.int32(0x0F800000)       # float16's exponent 31 (inf, NaN), shifted into place
_TO_EXP255 = np.int32(0x70000000)   # ... made float32's exponent 255, the payload kept
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


def _as_rows(a: np.ndarray):
    """a as a (rows, tokens, dim) view (the leading axes merged, the last contiguous), or None when
    that needs a copy. A padded cache's (1, heads, n, dim) slice is such a view."""
    if a.ndim < 2 or a.strides[-1] != a.itemsize:
        return None
    try:
        return np.reshape(a, (-1, a.shape[-2], a.shape[-1]), copy=False)
    except ValueError:              # the leading axes do not merge without a copy
        return None


def _f16_to_f32(dst: np.ndarray, src: np.ndarray) -> None:
    """dst, src: the same shape, 1-D contiguous or (rows, tokens, dim) with the last axis contiguous;
    chunks (along the tokens) keep the temporary in cache."""
    s16, o32 = src.view(np.int16), dst.view(np.int32)
    if s16.ndim == 1:
        t = np.empty(min(len(s16), CHUNK), np.int32)
        for a in range(0, len(s16), CHUNK):
            b = min(len(s16), a + CHUNK)
            _widen(o32[a:b], s16[a:b], t[:b - a])
        return
    rows, n, d = s16.shape
    step = max(1, CHUNK // (rows * d))
    t = np.empty((rows, min(step, n), d), np.int32)
    for a in range(0, n, step):
        b = min(n, a + step)
        _widen(o32[:, a:b], s16[:, a:b], t[:, :b - a])


def _to_f32_places(tt: np.ndarray, s16: np.ndarray) -> None:
    """tt (int32) = s16's float16 bits (as int16) at float32's places, before the 2**112 scale."""
    np.copyto(tt, s16)                              # sign-extended: the sign lands on bit 31
    np.left_shift(tt, 13, out=tt)
    np.bitwise_and(tt, _WIDE_KEEP, out=tt)          # sign, then exponent and mantissa at float32's places


def _fix_inf_nan(o: np.ndarray, tt: np.ndarray) -> None:
    """o (float32 bits as int32, scaled from tt): inf and NaN (exponent 31) get exponent 255, payload kept."""
    sel = (tt & _EXP31) == _EXP31
    o[sel] = tt[sel] | _TO_EXP255


def _widen(o: np.ndarray, s16: np.ndarray, tt: np.ndarray) -> None:
    """o (float32 bits as int32) = s16 (float16 bits as int16), through tt: five numpy passes."""
    _to_f32_places(tt, s16)
    f = o.view(np.float32)
    np.multiply(tt.view(np.float32), _MAGIC_UP, out=f)
    if f.max() >= 65536.0 or f.min() <= -65536.0:   # only inf and NaN (exponent 31) land there
        _fix_inf_nan(o, tt)


def widen_bits(bits: np.ndarray, src: np.ndarray) -> None:
    """A float16 -> float32 cast in two halves, for two threads (a restore's reader and the engine):
    this first half sets bits (int32, src's shape, both C-contiguous) to src's float16 bits at float32's
    places, before the 2**112 scale; finish() does the rest."""
    if bits.shape != src.shape or bits.dtype != np.int32 or src.dtype != np.float16 or \
            not (bits.flags.c_contiguous and src.flags.c_contiguous):
        raise ValueError(f"widen_bits: int32 and float16 arrays of one shape, contiguous "
                         f"({bits.dtype}{bits.shape} vs {src.dtype}{src.shape})")
    _to_f32_places(bits, src.view(np.int16))


def has_inf_or_nan(src: np.ndarray) -> bool:
    """Whether a float16 array (C-contiguous) holds inf or NaN (exponent 31), in chunks that stay in cache."""
    u16 = src.view(np.uint16).reshape(-1)
    probe = np.empty(min(len(u16), CHUNK), np.uint16)
    for a in range(0, len(u16), CHUNK):
        b = min(len(u16), a + CHUNK)
        np.bitwise_and(u16[a:b], 0x7C00, out=probe[:b - a])
        if int(probe[:b - a].max()) == 0x7C00:
            return True
    return False


def finish(dst: np.ndarray, bits: np.ndarray, src: np.ndarray) -> None:
    """The second half of widen_bits' cast: dst (float32, bits' shape, any strides) = src's float16
    values, from bits. One pass (and the inf/NaN probe of src), two more where src has inf or NaN."""
    np.multiply(bits.view(np.float32), _MAGIC_UP, out=dst)
    if has_inf_or_nan(src):
        _fix_inf_nan(dst.view(np.int32), bits)


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
    if src.dtype == np.float16:
        rows = _as_rows(dst), _as_rows(src)
        if rows[0] is not None and rows[1] is not None:
            _f16_to_f32(*rows)
            return
        for d, s in pairs:
            _f16_to_f32(d, s)
        return
    for d, s in pairs:
        _f32_to_f16(d, s)
