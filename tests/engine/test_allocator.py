"""engine/memory/allocator.py: freed blocks below 32 MiB stay with malloc for reuse (glibc), and the memory
guard counts what malloc holds free as available."""
from __future__ import annotations

import ctypes
import sys

import pytest

from engine.memory import allocator, memory_guard

glibc_only = pytest.mark.skipif(allocator._LIBC is None, reason="glibc's mallopt/mallinfo2 only (Linux with glibc)")


def _libc():
    """glibc with malloc/free typed for pointers."""
    libc = allocator._LIBC
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


@glibc_only
def test_a_freed_k_v_sized_block_stays_with_malloc():
    line = allocator.keep_freed_memory()
    assert "32 MiB" in line and "256 MiB" in line
    libc = _libc()
    size = 8 << 20                      # a layer's K/V at a few thousand tokens
    guard = libc.malloc(1 << 10)        # keeps the block off the heap's top, as live arrays do
    p = libc.malloc(size)
    keep = libc.malloc(1 << 10)
    ctypes.memset(p, 1, size)
    before = allocator.held_free_bytes()
    libc.free(p)
    held = allocator.held_free_bytes() - before
    assert held >= size                 # with glibc's defaults this block was an mmap, unmapped at free
    q = libc.malloc(size)               # and the next one of its size reuses it
    assert q == p
    for x in (q, guard, keep):
        libc.free(x)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux reader")
def test_the_linux_reading_counts_malloc_s_free_bytes(monkeypatch):
    monkeypatch.setattr(allocator, "held_free_bytes", lambda: 3 << 30)
    plain, linux = memory_guard.read_meminfo(), memory_guard.read_linux()
    assert linux.total_bytes == plain.total_bytes
    want = min(plain.total_bytes, plain.available_bytes + (3 << 30))
    assert abs(linux.available_bytes - want) < (256 << 20)      # MemAvailable may move between the reads


@glibc_only
def test_release_hands_malloc_s_free_memory_back():
    import psutil
    allocator.keep_freed_memory()
    libc = _libc()
    blocks = [libc.malloc(4 << 20) for _ in range(8)]
    for b in blocks:
        ctypes.memset(b, 1, 4 << 20)
    keep = libc.malloc(1 << 10)         # above them: they are a hole, not the heap's top
    for b in blocks:
        libc.free(b)
    me = psutil.Process()
    held_rss = me.memory_info().rss     # freed, still resident: kept for reuse
    allocator.release_freed_memory()
    assert held_rss - me.memory_info().rss >= 16 << 20
    libc.free(keep)
