"""Conversation parking: K/V of conversations that lost the engine, kept in RAM under a cap.

An entry holds the engine's own per-layer cache objects (moved, never copied). A request that
extends a parked conversation takes its entry back whole; one that shares only a prefix gets a copy of
that prefix and the entry stays parked.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

MIB = 1 << 20
# Reusing a handful of shared template tokens is not worth a copy (and would make "served from
# scratch" unobservable); below this a prefix counts as no match.
MIN_PREFIX_REUSE = 16
# (all layers, layers held here). A distributed pipeline rank holds some layers only (engine.distributed
# sets this); counting an entry as the whole model's K/V (every layer's cache has the same size) lets
# every rank make the same cap and eviction decisions. Integer arithmetic: exact on every rank.
WHOLE_MODEL_LAYERS = [1, 1]


@dataclass
class KVEntry:
    tokens: list[int]
    cache: list            # mlx-lm KVCache per layer, holding exactly `tokens`
    key: str               # model + steering identity: K/V is only reused under the same key
    messages: list[dict] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)

    def nbytes(self) -> int:
        local = sum(c.keys.nbytes + c.values.nbytes for c in self.cache if getattr(c, "keys", None) is not None)
        return local * WHOLE_MODEL_LAYERS[0] // WHOLE_MODEL_LAYERS[1]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def copy_prefix(cache: list, n: int, make_cache: Callable[[], list]) -> list:
    fresh = make_cache()
    for src, dst in zip(cache, fresh):
        if n > 0:
            dst.state = (mx.array(src.keys[..., :n, :]), mx.array(src.values[..., :n, :]), n)
    mx.eval([(c.keys, c.values) for c in fresh if c.keys is not None])
    return fresh


class Parking:
    def __init__(self, cap_mib: int, slots: int, guard, log: Callable[[str], None]):
        self.cap_bytes = max(0, int(cap_mib)) * MIB
        self.slots = max(1, int(slots))
        self.guard = guard
        self.log = log
        self.entries: list[KVEntry] = []

    @property
    def enabled(self) -> bool:
        return self.cap_bytes > 0

    def set_limits(self, cap_mib: int, slots: int) -> None:
        self.cap_bytes = max(0, int(cap_mib)) * MIB
        self.slots = max(1, int(slots))
        self._evict_until(lambda: self.total_bytes() <= self.cap_bytes and len(self.entries) <= self.slots)

    def total_bytes(self) -> int:
        return sum(e.nbytes() for e in self.entries)

    def status(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.total_bytes(), "cap_bytes": self.cap_bytes,
                "slots": self.slots, "tokens": [len(e.tokens) for e in self.entries]}

    def clear(self) -> None:
        self.entries.clear()

    def park(self, entry: KVEntry) -> bool:
        t0 = time.perf_counter()
        if not self.enabled:
            return False
        if not entry.tokens:
            return False
        reason = self.guard.unavailable_reason() if self.guard else None
        if reason:
            self.log(f"not parked: {reason}")
            return False
        size = entry.nbytes()
        if size > self.cap_bytes:
            # Alone larger than the cap: refusing it keeps everything else parked.
            self.log(f"not parked: {len(entry.tokens)} tokens need {size / MIB:.1f} MiB, "
                     f"more than the whole cap of {self.cap_bytes / MIB:.0f} MiB")
            return False
        self._evict_until(lambda: self.total_bytes() + size <= self.cap_bytes and len(self.entries) < self.slots)
        ok, why = self.guard.admit(0) if self.guard else (True, "")
        while not ok and self.entries:
            self._evict_one("the memory guard's reserve")
            ok, why = self.guard.admit(0)
        if not ok:
            self.log(f"not parked: {why}")
            return False
        entry.last_used = time.monotonic()
        self.entries.append(entry)
        self.log(f"parked {len(entry.tokens)} tokens in {(time.perf_counter() - t0) * 1e3:.1f} ms "
                 f"(bytes={size}, {len(self.entries)} parked, {self.total_bytes() / MIB:.1f} of "
                 f"{self.cap_bytes / MIB:.0f} MiB)")
        return True

    def take(self, tokens: list[int], key: str, make_cache: Callable[[], list]) -> tuple[KVEntry | None, int]:
        """The entry sharing the longest prefix with `tokens` (moved out if `tokens` extends it whole)."""
        best, best_n = None, 0
        for e in self.entries:
            if e.key != key:
                continue
            n = common_prefix(e.tokens, tokens)
            if n > best_n:
                best, best_n = e, n
        if best is None or best_n < min(MIN_PREFIX_REUSE, len(best.tokens)):
            return None, 0
        t0 = time.perf_counter()
        if best_n == len(best.tokens):
            self.entries.remove(best)
            best.last_used = time.monotonic()
            self.log(f"restored {best_n} tokens (moved) in {(time.perf_counter() - t0) * 1e3:.1f} ms")
            return best, best_n
        best.last_used = time.monotonic()
        entry = KVEntry(best.tokens[:best_n], copy_prefix(best.cache, best_n, make_cache), key)
        self.log(f"restored {best_n} of {len(best.tokens)} tokens (prefix copy) in "
                 f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
        return entry, best_n

    def _evict_one(self, why: str) -> None:
        victim = min(self.entries, key=lambda e: e.last_used)
        self.entries.remove(victim)
        self.log(f"evicted {len(victim.tokens)} tokens ({victim.nbytes() / MIB:.1f} MiB) for {why}")

    def _evict_until(self, fits: Callable[[], bool]) -> None:
        while self.entries and not fits():
            self._evict_one("the cap")
