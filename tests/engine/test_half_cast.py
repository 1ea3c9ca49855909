"""engine/model/half_cast.py against numpy's own cast: every float16 value one way; every float16 value's
float32 neighbours and rounding midpoints (the ties that round to even), the specials and a random
sample the other way; the layouts a session save and restore hand it."""
from __future__ import annotations

import numpy as np
import pytest

from engine.model import half_cast

ALL_HALF_BITS = np.arange(1 << 16, dtype=np.uint16)


def _numpy(dst_dtype, src):
    with np.errstate(all="ignore"):
        return src.astype(dst_dtype)


def test_every_float16_value_widens_bit_for_bit_as_numpy():
    src = ALL_HALF_BITS.view(np.float16)
    out = np.empty(len(src), np.float32)
    half_cast.cast(out, src)
    assert np.array_equal(out.view(np.uint32), _numpy(np.float32, src).view(np.uint32))   # NaN payloads too


def _rounding_cases() -> np.ndarray:
    """For every float16 value: its float32 bits and the float32s around it and around the midpoints
    to its neighbours (13 dropped bits: the midpoint is +-2**12 away)."""
    base = ALL_HALF_BITS.view(np.float16).astype(np.float32).view(np.uint32).astype(np.int64)
    deltas = (-(1 << 13), -(1 << 12) - 1, -(1 << 12), -(1 << 12) + 1, -1, 0, 1,
              (1 << 12) - 1, 1 << 12, (1 << 12) + 1)
    near = np.concatenate([(base + d) % (1 << 32) for d in deltas]).astype(np.uint32)
    specials = np.array([0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFFC00001, 0x7F802000,
                         0x477FEFFF, 0x477FF000, 0x477FFFFF, 0x47800000, 0x33000000, 0x33000001, 0x32FFFFFF,
                         0x387FFFFF, 0x38800000, 0x00000001, 0x80000000], np.uint32)
    tiny = np.arange(0, 1 << 24, 97, dtype=np.uint32)                 # float32 subnormals and tiny normals
    rand = np.random.default_rng(7).integers(0, 1 << 32, 2_000_000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([near, specials, specials | 0x80000000, tiny, rand])


def test_float32_narrows_bit_for_bit_as_numpy_at_every_rounding_boundary():
    src = _rounding_cases().view(np.float32)
    out = np.empty(len(src), np.float16)
    half_cast.cast(out, src)
    ref = _numpy(np.float16, src).view(np.uint16)
    bad = np.nonzero(out.view(np.uint16) != ref)[0]
    assert len(bad) == 0, [(hex(src.view(np.uint32)[i]), hex(ref[i]), hex(out.view(np.uint16)[i])) for i in bad[:5]]


@pytest.mark.parametrize("src_dtype,dst_dtype", [(np.float16, np.float32), (np.float32, np.float16)])
def test_the_layouts_sessions_use_a_padded_cache_slice_and_halves(src_dtype, dst_dtype):
    """(1, heads, n, dim) into a padded (1, heads, cells, dim) array's first n cells, and halves along
    the tokens (each head's rows contiguous, the heads apart): the padding is untouched."""
    rng = np.random.default_rng(3)
    n, cells, heads, dim = 300, 512, 3, 64
    src = rng.standard_normal((1, heads, n, dim)).astype(src_dtype)
    padded = np.full((1, heads, cells, dim), 7, dst_dtype)
    t = n // 2
    half_cast.cast(padded[:, :, :t, :], src[:, :, :t, :])
    half_cast.cast(padded[:, :, t:n, :], src[:, :, t:, :])
    assert np.array_equal(padded[:, :, :n, :], _numpy(dst_dtype, src))
    assert (padded[:, :, n:, :] == 7).all()


def test_chunk_edges_and_other_dtypes_and_layouts_fall_back_to_numpy(monkeypatch):
    monkeypatch.setattr(half_cast, "CHUNK", 1000)
    src = np.random.default_rng(5).standard_normal(4321).astype(np.float32)
    out = np.empty(4321, np.float16)
    half_cast.cast(out, src)
    assert np.array_equal(out, src.astype(np.float16))
    strided = np.empty(8642, np.float16)[::2]                      # no contiguous rows: numpy's cast
    half_cast.cast(strided, src)
    assert np.array_equal(strided, src.astype(np.float16))
    ints = np.empty(5, np.int32)
    half_cast.cast(ints, np.arange(5, dtype=np.float32))
    assert ints.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="shapes differ"):
        half_cast.cast(np.empty(3, np.float16), np.empty(4, np.float32))


def test_widening_in_chunks_of_rows_and_per_block_when_rows_do_not_merge(monkeypatch):
    """float16 -> float32 works on (rows, tokens, dim) views in chunks along the tokens; a layout whose
    leading axes do not merge into rows (every other head here) goes block by block."""
    monkeypatch.setattr(half_cast, "CHUNK", 1000)
    rng = np.random.default_rng(9)
    src = rng.standard_normal((2, 4, 37, 16)).astype(np.float16)
    src[0, 1, 3, 5], src[1, 2, 36, 0] = np.inf, np.nan                # specials in one chunk, not the others
    for dst in (np.full((2, 4, 64, 16), 7, np.float32)[:, :, :37, :],         # rows merge (padded cache)
                np.full((2, 8, 37, 16), 7, np.float32)[:, ::2]):              # rows do not merge
        half_cast.cast(dst, src)
        assert np.array_equal(dst.view(np.uint32), src.astype(np.float32).view(np.uint32))


def test_the_cast_in_two_halves_is_numpy_s_for_every_float16_value_into_a_padded_slice():
    """widen_bits (a restore's reader thread) then finish (the engine thread), into the first cells of
    a padded cache array: every float16 value, inf and NaN payloads included, bit for bit as numpy;
    the padding untouched. And without inf or NaN the fix-up pass finds nothing to do."""
    heads, n, cells, dim = 4, 256, 384, 64                  # 4 * 256 * 64 = every float16 bit pattern
    src = ALL_HALF_BITS.view(np.float16).reshape(1, heads, n, dim).copy()
    padded = np.full((1, heads, cells, dim), 7, np.float32)
    bits = np.empty(src.shape, np.int32)
    half_cast.widen_bits(bits, src)
    half_cast.finish(padded[:, :, :n, :], bits, src)
    want = _numpy(np.float32, src)
    assert np.array_equal(padded[:, :, :n, :].view(np.uint32), want.view(np.uint32))
    assert (padded[:, :, n:, :] == 7).all()
    assert half_cast.has_inf_or_nan(src)
    finite = np.random.default_rng(5).standard_normal((1, heads, n, dim)).astype(np.float16)
    assert not half_cast.has_inf_or_nan(finite)
    half_cast.widen_bits(bits, finite)
    half_cast.finish(padded[:, :, :n, :], bits, finite)
    assert np.array_equal(padded[:, :, :n, :], finite.astype(np.float32))
    one = finite.copy()
    one[0, 3, 200, 5] = -np.inf                             # a single special value
    assert half_cast.has_inf_or_nan(one)


def test_the_first_half_refuses_what_it_cannot_take():
    src = np.zeros((2, 8), np.float16)
    for bad in (np.zeros((2, 8), np.int64), np.zeros((2, 9), np.int32), np.zeros((8, 4), np.int32).T):
        with pytest.raises(ValueError, match="widen_bits"):
            half_cast.widen_bits(bad, src)
