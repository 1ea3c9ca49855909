"""Host bytes into an MLX array on the device, the fast way for each backend.

``mx.array(numpy)`` copies into memory MLX allocates for the host side. On Apple silicon that
memory is the GPU's too, and nothing more happens. On MLX's CUDA backend (0.32) it is CUDA managed
memory, and the first kernel that reads the array moves its pages over by page faults: ~3 GB/s on
an H200 host (bench/gpu.md, transfer_probe). MLX's ``Load`` primitive instead allocates device
memory and fills it with one ``cudaMemcpyAsync`` from a host buffer, and ``mx.load`` runs that
primitive for a Python file object. So on CUDA, ``to_device`` hands MLX a small file object that
serves an .npy header and then the caller's buffer: one host copy (into the buffer MLX reads into)
and one DMA, no page faults. Elsewhere it is ``mx.array``.
"""
from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from engine.device import on_cuda

COPY_THREADS = 4                # the host copy into MLX's buffer, split: one thread copies ~5 GB/s
COPY_MIN_PIECE = 2 << 20        # below this a split costs more than it saves
_copiers: ThreadPoolExecutor | None = None


def _copy(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src, in COPY_THREADS pieces for large buffers (numpy's copy releases the GIL)."""
    n = len(src)
    k = min(COPY_THREADS, n // COPY_MIN_PIECE)
    if k < 2:
        dst[:] = src
        return
    global _copiers
    if _copiers is None:
        _copiers = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="upload-copy")
    a, b = np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8)
    cuts = [n * i // k for i in range(k + 1)]
    rest = [_copiers.submit(np.copyto, a[cuts[i]:cuts[i + 1]], b[cuts[i]:cuts[i + 1]]) for i in range(1, k)]
    np.copyto(a[:cuts[1]], b[:cuts[1]])
    for f in rest:
        f.result()


class _NpyView(io.RawIOBase):
    """A read-only .npy "file": numpy's header for buf's shape and dtype, then buf's bytes (not
    copied until MLX's reader asks for them)."""

    def __init__(self, buf: np.ndarray):
        super().__init__()
        if not buf.flags.c_contiguous:
            raise ValueError("to_device needs a C-contiguous buffer")
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(buf))
        self._head = head.getvalue()
        self._body = memoryview(buf).cast("B")
        self._size = len(self._head) + len(self._body)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, off: int, whence: int = 0) -> int:
        base = (0, self._pos, self._size)[whence]
        self._pos = max(0, min(self._size, base + off))
        return self._pos

    def readinto(self, out) -> int:
        out = memoryview(out).cast("B")
        done = 0
        while done < len(out) and self._pos < self._size:
            if self._pos < len(self._head):
                src = self._head[self._pos:]
            else:
                src = self._body[self._pos - len(self._head):]
            k = min(len(out) - done, len(src))
            _copy(out[done:done + k], src[:k])
            done += k
            self._pos += k
        return done


def host_view(a: mx.array, keep_on_device: bool | None = None) -> np.ndarray:
    """A numpy view of an MLX array's values, to read on the host (a session save), that leaves `a`
    where it lives. On MLX's CUDA backend (0.32) any host read of an array's memory moves its buffer
    into CUDA managed memory for good (Buffer::raw_ptr -> move_to_unified_memory,
    mlx/backend/cuda/allocator.cpp), so a saved conversation's K/V would be read back to the device by
    page faults at its next step. There the view is of a device copy made for the read (its bits as
    unsigned integers times 1, viewed back: exact, NaN payloads too) and `a` stays in device memory.
    Elsewhere, or with ``keep_on_device=False`` (an array nobody keeps), it is `a`'s own memory."""
    if on_cuda() if keep_on_device is None else keep_on_device:
        bits = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.itemsize]
        a = mx.view(mx.view(a, bits) * 1, a.dtype)
    mx.eval(a)
    return np.asarray(a)


def drop_host_copies() -> None:
    """After host_view's reads on CUDA: MLX's buffer cache would hand the managed buffers of those
    copies to later device allocations (its cache matches sizes, not memory kinds), so empty it."""
    if on_cuda():
        mx.clear_cache()


def to_device(buf: np.ndarray, via_load: bool | None = None) -> mx.array:
    """An evaluated MLX array on the default device holding a copy of buf (C-contiguous, any shape;
    float16/float32/int32 and the other dtypes .npy and MLX share). ``via_load`` forces the path (the
    Load one runs on the CPU too: tests use it there)."""
    if not (on_cuda() if via_load is None else via_load):
        return mx.array(buf)
    return mx.load(_NpyView(buf), format="npy")
