"""engine/model/device_upload.py: host buffers into MLX arrays through MLX's Load primitive (the CUDA path,
run here on the CPU, where mx.load of a file object reads into the array's memory the same way)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.model import device_upload
from engine.model.device_upload import to_device


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int32, np.uint32])
@pytest.mark.parametrize("shape", [(1,), (3, 5), (1, 4, 300, 64)])
def test_the_load_path_gives_the_buffer_s_values_shape_and_dtype(dtype, shape):
    rng = np.random.default_rng(sum(shape))
    buf = (rng.standard_normal(shape) * 1000).astype(dtype)
    a = to_device(buf, via_load=True)
    assert tuple(a.shape) == shape and np.dtype(str(a.dtype).split(".")[-1]) == np.dtype(dtype)
    assert np.array_equal(np.array(a), buf)


def test_a_large_buffer_is_copied_in_pieces_and_arrives_whole(monkeypatch):
    """Above COPY_MIN_PIECE x 2 the host copy is split across threads: every byte still lands once, in
    its place (a pattern with no repeats at the piece size catches a shifted or doubled piece)."""
    monkeypatch.setattr(device_upload, "COPY_MIN_PIECE", 1 << 16)
    monkeypatch.setattr(device_upload, "_copiers", None)
    buf = np.arange(1_000_003, dtype=np.int32).reshape(1, -1)
    calls = []
    real = device_upload._copy

    def spy(dst, src):
        calls.append(len(src))
        real(dst, src)
    monkeypatch.setattr(device_upload, "_copy", spy)
    a = to_device(buf, via_load=True)
    assert calls and max(calls) == buf.nbytes
    assert device_upload._copiers is not None           # the body went through the copy threads
    assert np.array_equal(np.array(a), buf)


def test_a_non_contiguous_buffer_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="C-contiguous"):
        to_device(np.zeros((4, 4), np.float16)[:, ::2], via_load=True)


def test_off_cuda_it_is_mx_array():
    buf = np.ones((2, 3), np.float16)
    a = to_device(buf)
    assert isinstance(a, mx.array) and np.array_equal(np.array(a), buf)


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32, mx.uint32])
def test_host_view_reads_a_copy_when_asked_and_the_values_are_exact(dtype):
    """host_view on CUDA reads a device copy (the live array's buffer must not be moved into managed
    memory by a host read); the copy is exact, -0.0 and NaN included. Forced here on any backend."""
    from engine.model.device_upload import host_view
    vals = np.array([[-0.0, 1.5, np.nan, -2.25, 65504.0, 6e-8]], np.float32)
    a = mx.array(vals.astype(np.float16) if dtype == mx.float16 else vals).astype(dtype) if dtype != mx.uint32 \
        else mx.array(np.arange(12, dtype=np.uint32).reshape(2, 6))
    mx.eval(a)
    own = np.asarray(a)
    copy = host_view(a, keep_on_device=True)
    plain = host_view(a, keep_on_device=False)
    assert copy.tobytes() == own.tobytes() == plain.tobytes()       # bit for bit, sign of zero and NaN kept
    assert not np.shares_memory(copy, own) and np.shares_memory(plain, own)
