"""Freed K/V memory kept for reuse, on Linux with glibc (a no-op elsewhere).

MLX's CPU backend allocates with malloc. glibc serves any block above its mmap threshold (128 KiB,
raised only to the size of the last freed block) with a fresh mmap and gives it back at free, and it
trims a freed heap top above 128 KiB: so each K/V array (1-10 MiB a layer) is new memory that the
kernel faults in page by page and zeroes. A restored session's 94 MB float32 cache then costs ~48 ms
of building alone, several times llama.cpp's whole 12 ms restore (bench/README.md). With a
32 MiB mmap threshold and a 256 MiB trim threshold the arrays live on the heap, and a conversation
evicted or replaced leaves memory the next one reuses without faults (`bench/allocator_probe.py`:
the restore's build 22.8 ms with the setting, 48.0 ms without). The engine thread allocates from its
own arena, whose 64 MiB heaps glibc unmaps as soon as one is wholly free, whatever the trim threshold;
a top pad of 64 MiB keeps them (glibc's heap_trim keeps a heap when the pad is at least a heap's
size), so K/V memory touched at load (kv_reserve.py) is still there for a restore: a restore into a
new process 25 ms with it, 45 ms without it, 67 ms with nothing touched (bench/README.md).

The cost is memory malloc holds after a free instead of returning it: at most what the engine thread
held at its peak (the live and parked conversations, which the conversation cache bounds).
`held_free_bytes()` reports it and the memory guard counts it as available (this process's next
allocation reuses it), and a stopping engine hands it back (`release_freed_memory`).
Model weights (one mmap'd file, or arrays far above 32 MiB) are not affected.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

MMAP_THRESHOLD = 32 << 20      # glibc's own ceiling for its dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 256 << 20
TOP_PAD = 64 << 20             # >= a thread arena's heap (HEAP_MAX_SIZE, 64 MiB on 64-bit): none is unmapped
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3     # <malloc.h>


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallinfo2.restype = _Mallinfo2      # glibc >= 2.33; musl has neither
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _glibc()
_applied = False


def keep_freed_memory() -> str:
    """Set the thresholds (once per process); says what was done, for the engine's log."""
    global _applied
    if _LIBC is None:
        return "allocator: left as is (not glibc)"
    if not _applied:
        ok = _LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and \
            _LIBC.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and \
            _LIBC.mallopt(_M_TOP_PAD, TOP_PAD) == 1
        if not ok:
            return "allocator: glibc refused the thresholds; left as is"
        _applied = True
    return (f"allocator: blocks up to {MMAP_THRESHOLD >> 20} MiB from the heap, freed memory kept up to "
            f"{TRIM_THRESHOLD >> 20} MiB at its top and in whole thread heaps (K/V arrays reused without page faults)")


def keeps_freed_memory() -> bool:
    """Whether keep_freed_memory() took effect in this process (freed K/V memory is reused, not returned)."""
    return _applied


def release_freed_memory() -> None:
    """Give what malloc holds free back to the system (malloc_trim; every arena): when an engine stops,
    the memory it freed is nobody's to reuse."""
    if _LIBC is not None:
        try:
            _LIBC.malloc_trim(0)
        except (OSError, AttributeError):
            pass


def held_free_bytes() -> int:
    """Bytes malloc holds free for this process (0 where it cannot be read)."""
    if _LIBC is None:
        return 0
    try:
        return int(_LIBC.mallinfo2().fordblks)
    except (OSError, AttributeError):
        return 0
