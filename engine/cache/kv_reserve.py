"""K/V memory touched once at load on the CPU, so a restore (or a first prefill) in a new process
writes into pages the process already has.

Why: a session restored into a new process -- what session files are for -- needs the cache's arrays
(94 MB of float32 for 2,048 tokens of SmolLM2), and fresh memory costs a page fault and a kernel-zeroed
page per 4 KiB: ~45 ms of a ~95 ms restore on the project's 2-vCPU VM, against 3.5 ms on pages the
process has touched before (bench/README.md). llama.cpp pays the same cost when its context is
created: it allocates and clears the whole K/V buffer for n_ctx tokens, and its restore reads into it.
This does the same at load: it allocates the arrays a restore of the whole context would (capped), in
the cache's dtype, lets MLX zero them and frees them. With glibc's thresholds raised
(engine/memory/allocator.py) the freed memory stays with malloc, and the next K/V arrays of this thread are
carved from it without faults.

Only on the CPU with glibc (elsewhere the allocator keeps nothing: a no-op), and only what the memory
guard admits. The bytes stay counted as available (allocator.held_free_bytes), so parking and the
guard see no loss; a stopping engine gives them back (allocator.release_freed_memory).

Later, between requests (TopUp): once the K/V held has used up a quarter or more of those free bytes
(a restore, a long prefill), the engine touches them again in its idle time, one array at a time
between looks at its queue, so the next restore in this process also writes to resident pages. A
request that arrives meanwhile waits for one array at most (~1-8 MiB) and the top-up stops there.
Without it a second restore in one process, while parking keeps the conversation it replaced, took
71-292 ms on fresh pages against 26-28 ms on reused ones (bench/README.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from engine.memory import allocator

STEP = 256                              # mlx-lm's KVCache grows in steps of this many cells
CAP_BYTES = allocator.TRIM_THRESHOLD    # what malloc is allowed to keep free anyway
LOW_WATER = 0.75                        # a top-up starts when less than this share of the reserve is free


@dataclass(frozen=True)
class Reserved:
    tokens: int             # K/V cells per layer touched (0: nothing done)
    nbytes: int
    ms: float
    note: str               # the engine's log line
    shape: tuple = ()       # one array's shape, (1, K/V heads, tokens, head size)
    count: int = 0          # arrays touched (K and V of every layer)
    dtype: object = None

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
    note = (f"K/V memory: {nbytes / (1 << 20):.1f} MiB touched at load ({cells} tokens of "
            f"{str(dtype).removeprefix('mlx.core.')} K/V, {ms:.0f} ms): restores and prefills up to that "
            f"length write to resident pages")
    return Reserved(cells, nbytes, ms, note, shape=(1, n_kv_heads, cells, head_dim), count=2 * n_layer, dtype=dtype)


class TopUp:
    """The reserve touched at load, touched again in the engine's idle time once it is used up
    (see the module's docstring). Engine thread only: the arrays must come from its malloc arena."""

    def __init__(self, reserved: Reserved, admit=None):
        self.reserved = reserved
        self.admit = admit
        self._held: list = []
        self._t0 = 0.0
        # The K/V the engine held when the reserve was last whole. malloc's own count of free bytes
        # (mallinfo2) is no measure of it: it spans every arena and also counts what loading the
        # weights left free on other threads.
        self._base = 0
        self._next_base = 0

    @classmethod
    def of(cls, reserved: Reserved, admit=None) -> "TopUp | None":
        return cls(reserved, admit) if reserved.count and allocator.keeps_freed_memory() else None

    def wanted(self, held: int) -> bool:
        """Whether the K/V held (`held` bytes, live and parked) has grown by a quarter of the reserve
        or more since it was last whole, and the memory guard lets that much be touched again. K/V
        freed meanwhile (evicted, replaced) went back to malloc resident, so it counts as reserve."""
        self._base = min(self._base, held)
        grown = held - self._base
        if grown < self.reserved.nbytes * (1 - LOW_WATER):
            return False
        if self.admit is not None and not self.admit(min(grown, self.reserved.nbytes))[0]:
            return False
        self._next_base = held
        return True

    def step(self) -> str | None:
        """Touch one array more. When all are held, free them (to malloc, resident) and return the
        log line; None while some are left."""
        if not self._held:
            self._t0 = time.perf_counter()
        a = mx.zeros(self.reserved.shape, self.reserved.dtype)
        mx.eval(a)
        self._held.append(a)
        if len(self._held) < self.reserved.count:
            return None
        self.release()
        self._base = self._next_base
        ms = (time.perf_counter() - self._t0) * 1e3
        return (f"K/V memory: {self.reserved.nbytes / (1 << 20):.1f} MiB touched again in idle time "
                f"({ms:.0f} ms): the next restore writes to resident pages")

    def release(self) -> None:
        """Free what this top-up holds (a request arrived, or it is done): resident free memory."""
        if self._held:
            self._held.clear()
            mx.clear_cache()            # MLX's own buffer cache would keep some; malloc should have them


class IdleTopUp:
    """The scheduler's idle task (engine/scheduler.py) around the loaded model's TopUp, if any: one
    array touched between looks at the queue, a request that comes first ends it and frees what was
    touched so far."""

    def __init__(self, held_bytes, log):
        self.topup: TopUp | None = None
        self._held_bytes = held_bytes       # () -> the K/V bytes held, live and parked
        self._log = log

    def use(self, topup: TopUp | None) -> None:
        """The TopUp of the model just loaded (None: nothing to top up)."""
        self.topup = topup

    def due_in(self) -> float | None:
        return None

    def run(self, interrupted) -> None:
        topup = self.topup
        try:
            if topup is None or not topup.wanted(self._held_bytes()):
                return
            while not interrupted():
                done = topup.step()
                if done:
                    self._log(done)
                    break
            topup.release()             # a request came first: what was touched so far is free again
        except Exception as e:  # noqa: BLE001 - an optimisation: never worth the engine thread
            if topup is not None:
                topup.release()
            self.topup = None
            self._log(f"K/V memory: idle-time top-up stopped ({e!r})")
