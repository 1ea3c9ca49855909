"""K/V memory touched once at load on the CPU, so a restore (or a first prefill) in a new process
writes into pages the process already has.

Why: a session restored into a new process -- what session files are for -- needs the cache's arrays
(94 MB of float32 for 2,048 tokens of SmolLM2), and fresh memory costs a page fault and a kernel-zeroed
page per 4 KiB: ~45 ms of a ~95 ms restore on the project's 2-vCPU VM, against 3.5 ms on pages the
process has touched before (bench/README.md, issue 18). llama.cpp pays the same cost when its context is
created: it allocates and clears the whole K/V buffer for n_ctx tokens, and its restore reads into it.
This does the same at load: it allocates the arrays a restore of the whole context would (capped), in
the cache's dtype, lets MLX zero them and frees them. With glibc's thresholds raised
(engine/allocator.py) the freed memory stays with malloc, and the next K/V arrays of this thread are
carved from it without faults.

Only on the CPU with glibc (elsewhere the allocator keeps nothing: a no-op), and only what the memory
guard admits. The bytes stay counted as available (allocator.held_free_bytes), so parking and the
guard see no loss; a stopping engine gives them back (allocator.release_freed_memory).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from . import allocator

STEP = 256                              # mlx-lm's KVCache grows in steps of this many cells
CAP_BYTES = allocator.TRIM_THRESHOLD    # what malloc is allowed to keep free anyway


@dataclass(frozen=True)
class Reserved:
    tokens: int             # K/V cells per layer touched (0: nothing done)
    nbytes: int
    ms: float
    note: str               # the engine's log line

    @classmethod
    def none(cls, why: str) -> "Reserved":
        return cls(0, 0, 0.0, f"K/V memory: not touched at load ({why})")


def plan(n_ctx: int, n_layer: int, n_kv_heads: int, head_dim: int, itemsize: int,
         cap: int = CAP_BYTES) -> tuple[int, int]:
    """(cells, bytes): the context's K/V, at most `cap` bytes, in whole steps of mlx-lm's cache."""
    per_cell = 2 * n_layer * n_kv_heads * head_dim * itemsize
    if per_cell <= 0 or n_ctx <= 0:
        return 0, 0
    cells = min(-(-n_ctx // STEP) * STEP, cap // per_cell // STEP * STEP)
    return cells, cells * per_cell


def touch(n_ctx: int, n_layer: int, n_kv_heads: int, head_dim: int, dtype, admit=None,
          cap: int = CAP_BYTES) -> Reserved:
    """Allocate, zero (by MLX) and free one cache's worth of K/V arrays on this thread (the engine
    thread: glibc gives each thread its own arena, and the restores run here)."""
    if not allocator.keeps_freed_memory():
        return Reserved.none("the allocator returns freed memory to the system here")
    cells, nbytes = plan(n_ctx, n_layer, n_kv_heads, head_dim, mx.zeros((), dtype).itemsize, cap)
    if cells == 0:
        return Reserved.none("no K/V to touch")
    if admit is not None:
        ok, why = admit(nbytes)
        if not ok:
            return Reserved.none(f"the memory guard says no: {why}")
    t = time.perf_counter()
    arrays = [mx.zeros((1, n_kv_heads, cells, head_dim), dtype) for _ in range(2 * n_layer)]
    mx.eval(arrays)
    del arrays
    mx.clear_cache()                    # MLX's own buffer cache keeps 32 MB; the rest goes to malloc
    ms = (time.perf_counter() - t) * 1e3
    return Reserved(cells, nbytes, ms, f"K/V memory: {nbytes / (1 << 20):.1f} MiB touched at load ({cells} "
                                       f"tokens of {str(dtype).removeprefix('mlx.core.')} K/V, {ms:.0f} ms): "
                                       f"restores and prefills up to that length write to resident pages")
